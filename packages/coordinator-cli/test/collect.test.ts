/**
 * The collector's resend rule is the error catalogue's: a refusal whose retry rule is
 * `after_resume` is sent again; any other refusal loses the episode after one send.
 */
import { once } from 'node:events';
import type { Server } from 'node:http';
import type { AddressInfo } from 'node:net';

import { createHttpClients, type HttpClients } from '@ckpt-gym/core/client';
import { type ErrorCode } from '@ckpt-gym/core/protocol';
import express from 'express';

import { Collector, counterTask, type ResultRow } from '../src/collect.js';

let server: Server | undefined;
let clients: HttpClients | undefined;

afterEach(() => {
  server?.closeAllConnections();
  server?.close();
  clients?.close();
});

/** An environment server whose `/run` refuses with `code` `refusals` times, then answers. */
async function refusingEnv(
  code: ErrorCode,
  refusals: number,
): Promise<{ url: string; runs: () => number }> {
  let runs = 0;
  const app = express();
  app.post('/run', (_req, res) => {
    runs += 1;
    if (runs <= refusals) {
      res.status(409).json({ error: { code, detail: `refused (${code})` } });
      return;
    }
    res.json({ result: { reward: 1 }, failure: null });
  });
  server = app.listen(0, '127.0.0.1');
  await once(server, 'listening');
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, runs: () => runs };
}

async function collectOne(envUrl: string) {
  clients = createHttpClients();
  const rows: ResultRow[] = [];
  const collector = new Collector({
    envUrl,
    concurrency: 1,
    client: clients.data,
    onResult: (row) => void rows.push(row),
  });
  collector.enqueue([{ episode: { rollout_id: 'r1', attempt: 0 }, task: counterTask(0) }]);
  await collector.settled();
  return { rows, lost: [...collector.lost.values()].map((l) => l.reason) };
}

test('an after_resume refusal (admission_closed) is sent again until it is admitted', async () => {
  const env = await refusingEnv('admission_closed', 2);
  const { rows, lost } = await collectOne(env.url);
  expect([env.runs(), rows.map((r) => r.rollout_id), lost]).toEqual([3, ['r1'], []]);
});

test.each(['stale_attempt', 'deadline_exceeded'] as const)(
  'a refusal with another rule (%s) is sent once and loses the episode',
  async (code) => {
    const env = await refusingEnv(code, 1);
    const { rows, lost } = await collectOne(env.url);
    expect([env.runs(), rows, lost]).toEqual([1, [], [expect.stringContaining(code)]]);
  },
);
