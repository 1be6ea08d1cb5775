#!/usr/bin/env node
/**
 * `node dist/main.js --config <stack file> --server <name> [--port N]`: runs one policy model
 * server of a stack. Prints one JSON line `{"event":"listening",…}` to stdout once it accepts
 * calls; SIGTERM or SIGINT closes it (open connections included) and exits 0. A bad stack file or
 * option exits 2; a port in use exits 1.
 */
import { parseArgs } from 'node:util';

import { CkptGymError, listen, loadStackFile, serverSettings } from '@ckpt-gym/core';

import { createPolicyModelServer } from './app.js';

function fail(message: string, code = 2): never {
  process.stderr.write(`ckpt-gym-policy-model: ${message}\n`);
  process.exit(code);
}

let values;
try {
  ({ values } = parseArgs({
    args: process.argv.slice(2),
    options: {
      config: { type: 'string' },
      server: { type: 'string' },
      port: { type: 'string' },
    },
    strict: true,
  }));
} catch (err) {
  fail((err as Error).message);
}
if (!values.config || !values.server)
  fail('usage: --config <stack file> --server <name> [--port N]');
if (values.port !== undefined && !/^\d+$/.test(values.port))
  fail(`--port must be an integer, got ${values.port}`);

let built;
try {
  const stack = loadStackFile(values.config);
  const server = serverSettings(stack, values.server);
  built = { server, model: await createPolicyModelServer(server, stack) };
} catch (err) {
  fail(err instanceof CkptGymError ? err.message : String(err));
}

const port = values.port !== undefined ? Number(values.port) : built.server.port;
const running = await listen(built.model.app, port, built.server.host).catch((err: unknown) =>
  fail(`cannot listen: ${(err as Error).message}`, 1),
);
process.stdout.write(
  `${JSON.stringify({
    event: 'listening',
    server: built.server.name,
    host: running.host,
    port: running.port,
    url: running.url,
  })}\n`,
);

let stopping = false;
const stop = (): void => {
  if (stopping) return;
  stopping = true;
  const closed = running.close();
  running.server.closeAllConnections();
  closed.then(
    () => process.exit(0),
    (err: unknown) => fail(`close failed: ${String(err)}`, 1),
  );
};
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
