/**
 * Every failure to reach or use the inference backend is a 502 `upstream_error` that names the
 * backend and shows no internal text (no socket error, no stack), and is logged with its cause.
 * A call's request id travels on to the backend (what ties the two servers' lines together).
 */
import { once } from 'node:events';
import { createServer, type RequestListener, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';

import { afterEach, describe, expect, it } from '@jest/globals';

import {
  CHAT_BODY,
  chat,
  cleanup,
  closedPort,
  post,
  recordingLogger,
  type Reply,
  startHarness,
} from './support.js';

const backends: Server[] = [];

afterEach(async () => {
  for (const server of backends.splice(0)) {
    server.closeAllConnections();
    server.close();
  }
  await cleanup();
});

/** A backend on a loopback port that answers every request with `answer`. */
async function brokenBackend(answer: RequestListener): Promise<string> {
  const server = createServer(answer);
  backends.push(server);
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}/v1`;
}

function expectUpstreamError(reply: Reply, backendUrl: string, what: RegExp): void {
  expect([reply.status, reply.headers.get('x-should-retry')]).toEqual([502, 'true']);
  const error = (reply.body as { error: { code: string; detail: string } }).error;
  expect(error.code).toBe('upstream_error');
  expect(error.detail).toContain(`the inference backend at ${backendUrl} `);
  expect(error.detail).toMatch(what);
  expect(error.detail).not.toMatch(/ECONN|socket|hang up|aborted|Error|\n\s+at /);
}

describe('a backend outage', () => {
  it('is a logged 502 upstream_error naming the backend on every proxied route, without the socket error', async () => {
    const backendUrl = `http://127.0.0.1:${await closedPort()}/v1`;
    const { logger, lines } = recordingLogger();
    const h = await startHarness({ backendUrl, logger });
    const replies = [
      await chat(h.url, 'r'),
      await post(`${h.url}/ng-rollout/r/v1/responses`, { model: 'fake-model', input: 'weather?' }),
      await chat(h.url, undefined, { ...CHAT_BODY, stream: true }),
    ];
    const models = await fetch(`${h.url}/v1/models`);
    replies.push({ status: models.status, headers: models.headers, body: await models.json() });
    for (const reply of replies) expectUpstreamError(reply, backendUrl, /could not be reached$/);
    const warned = lines.filter((line) => line.level === 'warn');
    expect(warned).toHaveLength(4);
    for (const line of warned) {
      expect(line.message).toBe('the inference backend failed');
      expect(line.meta?.error).toMatch(/ECONNREFUSED/);
      expect(line.meta?.detail).toContain(backendUrl);
    }
  });
});

describe('a backend answering garbage', () => {
  it('a 200 whose body is not a JSON object is a logged 502', async () => {
    const backendUrl = await brokenBackend((_req, res) => {
      res.writeHead(200, { 'content-type': 'text/html' });
      res.end('<html>bad gateway</html>');
    });
    const { logger, lines } = recordingLogger();
    const h = await startHarness({ backendUrl, logger });
    expectUpstreamError(await chat(h.url, 'r'), backendUrl, /answered with no JSON object$/);
    expect(lines.map((line) => [line.level, line.message, line.meta?.error])).toEqual([
      ['warn', 'the inference backend failed', 'HTTP 200 <html>bad gateway</html>'],
    ]);
  });

  it('an answer cut off before its end, JSON or event stream, is a logged 502', async () => {
    const backendUrl = await brokenBackend((req, res) => {
      let body = '';
      req.on('data', (chunk: Buffer) => (body += chunk.toString()));
      req.on('end', () => {
        const stream = (JSON.parse(body) as { stream?: boolean }).stream === true;
        res.writeHead(200, {
          'content-type': stream ? 'text/event-stream' : 'application/json',
          'content-length': '1000',
        });
        res.write(stream ? ': keep-alive\n\n' : '{"id": "x", "choi');
        setImmediate(() => res.destroy());
      });
    });
    const { logger, lines } = recordingLogger();
    const h = await startHarness({ backendUrl, logger });
    expectUpstreamError(await chat(h.url, 'r'), backendUrl, /broke off its answer$/);
    expectUpstreamError(
      await chat(h.url, 'r', { ...CHAT_BODY, stream: true }),
      backendUrl,
      /broke off its answer$/,
    );
    const warned = lines.filter((line) => line.level === 'warn');
    expect(warned.map((line) => line.message)).toEqual([
      'the inference backend failed',
      'the inference backend failed',
    ]);
    for (const line of warned) expect(line.meta?.error).toMatch(/aborted|ECONNRESET|hang up/);
  });
});

describe('request ids', () => {
  it('a generation call and a models call carry their request id on to the backend', async () => {
    const ids: (string | string[] | undefined)[] = [];
    const backendUrl = await brokenBackend((req, res) => {
      ids.push(req.headers['x-request-id']);
      req.resume();
      res.writeHead(200, { 'content-type': 'application/json' });
      res.end(
        JSON.stringify({
          id: 'c1',
          object: 'chat.completion',
          model: 'fake-model',
          choices: [{ index: 0, message: { role: 'assistant', content: 'sunny' } }],
          data: [],
        }),
      );
    });
    const h = await startHarness({ backendUrl });
    const reply = await post(`${h.url}/v1/chat/completions`, CHAT_BODY, {
      'x-request-id': 'gen-call-1',
    });
    expect([reply.status, reply.headers.get('x-request-id')]).toEqual([200, 'gen-call-1']);
    const models = await fetch(`${h.url}/v1/models`, { headers: { 'x-request-id': 'models-1' } });
    expect(models.status).toBe(200);
    expect(ids).toEqual(['gen-call-1', 'models-1']);
  });
});
