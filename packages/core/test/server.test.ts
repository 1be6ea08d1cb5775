import { execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';

import express from 'express';

import {
  createGymApp,
  healthReply,
  KEEP_ALIVE_IDLE_MS,
  LAUNCH_ID_ENV,
  listen,
  SERVER_HEADERS_TIMEOUT_MS,
  SERVER_KEEP_ALIVE_MS,
} from '../src/index.js';

describe('GET /health', () => {
  async function health(): Promise<{ status: number; body: unknown }> {
    const gym = createGymApp({ name: 'policy', kind: 'model', checkpoint: undefined });
    const running = await listen(gym.finish(), 0);
    try {
      const reply = await fetch(`${running.url}/health`);
      return { status: reply.status, body: await reply.json() };
    } finally {
      await running.close();
    }
  }

  afterEach(() => {
    delete process.env[LAUNCH_ID_ENV];
  });

  test("names the server and its process: the pid and the launcher's nonce", async () => {
    process.env[LAUNCH_ID_ENV] = 'launch-1234';
    expect(await health()).toEqual({
      status: 200,
      body: {
        status: 'ok',
        name: 'policy',
        kind: 'model',
        pid: process.pid,
        launch_id: 'launch-1234',
      },
    });
  });

  test('a process started without a launcher has a null launch id', async () => {
    expect(await health()).toEqual({
      status: 200,
      body: { status: 'ok', name: 'policy', kind: 'model', pid: process.pid, launch_id: null },
    });
  });

  test('the reply reads the pid and the nonce of the process it is given', () => {
    const proc = { pid: 42, env: { [LAUNCH_ID_ENV]: 'n-1' } };
    expect(healthReply('tools', 'resources', proc)).toEqual({
      status: 'ok',
      name: 'tools',
      kind: 'resources',
      pid: 42,
      launch_id: 'n-1',
    });
  });
});

describe('listen', () => {
  test('servers keep idle connections longer than clients do, so the client always closes first', async () => {
    const running = await listen(express(), 0);
    try {
      expect(SERVER_KEEP_ALIVE_MS).toBeGreaterThan(KEEP_ALIVE_IDLE_MS);
      expect(running.server.keepAliveTimeout).toBe(SERVER_KEEP_ALIVE_MS);
      expect(running.server.headersTimeout).toBeGreaterThan(running.server.keepAliveTimeout);
    } finally {
      await running.close();
    }
  });

  test('a busy server does not answer 408 to a request that waits to be read', async () => {
    const running = await listen(express(), 0);
    try {
      expect(SERVER_HEADERS_TIMEOUT_MS).toBeGreaterThanOrEqual(10 * 60_000);
      expect(running.server.headersTimeout).toBe(SERVER_HEADERS_TIMEOUT_MS);
      expect(running.server.requestTimeout).toBe(0);
    } finally {
      await running.close();
    }
  });

  test("the accept queue holds a burst of thousands of connections, not node's 511", async () => {
    const running = await listen(express(), 0);
    try {
      // For a listening socket `ss` shows the accept queue's size as Send-Q.
      const line = execFileSync('ss', ['-Hltn', `sport = :${running.port}`], { encoding: 'utf8' });
      const backlog = Number(line.trim().split(/\s+/)[2]);
      const kernelMax = Number(readFileSync('/proc/sys/net/core/somaxconn', 'utf8'));
      expect(backlog).toBe(Math.min(kernelMax, 65_535));
      expect(backlog).toBeGreaterThan(511);
    } finally {
      await running.close();
    }
  });
});
