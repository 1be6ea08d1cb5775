import { execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { connect } from 'node:net';

import express from 'express';

import { jsonBody } from '../src/express.js';
import { KEEP_ALIVE_IDLE_MS } from '../src/http-client.js';
import {
  createGymApp,
  healthReply,
  LAUNCH_ID_ENV,
  listen,
  SERVER_HEADERS_TIMEOUT_MS,
  SERVER_KEEP_ALIVE_MS,
} from '../src/server.js';

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

  test('a request node cannot parse is answered in the JSON error shape: 431 for too large headers, 400 otherwise', async () => {
    const app = express();
    app.post('/', jsonBody('1mb'), (_req, res) => {
      res.json({});
    });
    const running = await listen(app, 0);
    try {
      const huge = `GET / HTTP/1.1\r\nhost: x\r\nx-big: ${'a'.repeat(100_000)}\r\n\r\n`;
      expect(parseResponse(await rawExchange(running.port, huge))).toEqual({
        status: 'HTTP/1.1 431 Request Header Fields Too Large',
        contentType: 'application/json; charset=utf-8',
        body: {
          error: {
            code: 'headers_too_large',
            detail: expect.stringMatching(/^request headers are larger than \d+ bytes$/),
          },
        },
      });
      // The parser's answers skip sendError; they carry the catalogue's retry rule all the same.
      expect(await rawExchange(running.port, huge)).toMatch(/\r\nx-should-retry: false\r\n/);
      for (const request of [
        'GE T / HTTP/1.1\r\nhost: x\r\n\r\n',
        'GET / HTTP/9\r\n\r\n',
        'POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n',
        // The route is already reading this body when its framing breaks.
        `POST / HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n`,
      ]) {
        expect([request, parseResponse(await rawExchange(running.port, request))]).toEqual([
          request,
          {
            status: 'HTTP/1.1 400 Bad Request',
            contentType: 'application/json; charset=utf-8',
            body: {
              error: {
                code: 'malformed_request',
                detail: expect.stringMatching(/^the HTTP request could not be parsed: /),
              },
            },
          },
        ]);
      }
      const extensions = `POST / HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n2;${'e'.repeat(20_000)}\r\n{}\r\n0\r\n\r\n`;
      expect(parseResponse(await rawExchange(running.port, extensions))).toEqual({
        status: 'HTTP/1.1 413 Payload Too Large',
        contentType: 'application/json; charset=utf-8',
        body: {
          error: { code: 'payload_too_large', detail: 'request chunk extensions are too large' },
        },
      });
    } finally {
      await running.close();
    }
  });
});

/** Writes `request` on a fresh connection and resolves with everything read until it closes. */
function rawExchange(port: number, request: string): Promise<string> {
  return new Promise((resolve, reject) => {
    const socket = connect(port, '127.0.0.1');
    const chunks: Buffer[] = [];
    socket.on('data', (chunk: Buffer) => chunks.push(chunk));
    socket.on('error', reject);
    socket.on('close', () => resolve(Buffer.concat(chunks).toString('utf8')));
    socket.write(request);
  });
}

function parseResponse(raw: string): { status: string; contentType: string; body: unknown } {
  const [head = '', body = ''] = raw.split('\r\n\r\n');
  const [status = '', ...headers] = head.split('\r\n');
  const contentType = headers.find((h) => /^content-type:/i.test(h))?.replace(/^[^:]+:\s*/, '');
  return { status, contentType: contentType ?? '', body: body === '' ? '' : JSON.parse(body) };
}
