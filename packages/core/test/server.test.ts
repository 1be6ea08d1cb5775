import { execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';

import express from 'express';

import {
  KEEP_ALIVE_IDLE_MS,
  listen,
  SERVER_HEADERS_TIMEOUT_MS,
  SERVER_KEEP_ALIVE_MS,
} from '../src/index.js';

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
