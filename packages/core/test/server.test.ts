import express from 'express';

import { KEEP_ALIVE_IDLE_MS, listen, SERVER_KEEP_ALIVE_MS } from '../src/index.js';

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
});
