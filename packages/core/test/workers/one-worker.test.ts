import { readdirSync } from 'node:fs';

import express from 'express';

import {
  type FromStackOptions,
  type ServerKindModule,
  startServer,
} from '../../src/server-kind.js';
import { listenGymServer } from '../../src/server-kind.js';
import { parseStackFile, serverSettings } from '../../src/settings.js';
import { ToyCoordinator } from './toy.js';

const STACK = parseStackFile(
  [
    'checkpoint: { enabled: true, control_auth_token: tok }',
    'servers:',
    '  toy: { kind: resources, app: toy, port: 0, num_workers: 1 }',
  ].join('\n'),
);

describe('a kind that supports workers, run with one worker', () => {
  test('starts as before: no worker context, no coordinator, no runtime directory', async () => {
    const seen: FromStackOptions[] = [];
    let coordinators = 0;
    const kind: ServerKindModule = {
      kind: 'resources',
      configSchema: { apps: {} },
      workers: {
        coordinator: (_stack, name, { expectedWorkers }) => {
          coordinators += 1;
          return new ToyCoordinator({ kind: 'resources', instance: name, expectedWorkers });
        },
      },
      fromStack: async (stack, name, options = {}) => {
        seen.push(options);
        return listenGymServer(serverSettings(stack, name), express(), options, {
          plane: undefined,
          close: (l) => l.close(),
        });
      },
    };
    const lines: string[] = [];
    const server = await startServer(kind, STACK, 'toy', { port: 0 }, (l) => void lines.push(l));
    try {
      expect(seen).toEqual([{ port: 0 }]);
      expect(coordinators).toBe(0);
      expect(readdirSync('/tmp').filter((n) => n.startsWith(`cg-${process.pid}-`))).toEqual([]);
      expect(JSON.parse(lines[0]!)).toMatchObject({ event: 'listening', port: server.port });
    } finally {
      await server.close();
    }
  });
});
