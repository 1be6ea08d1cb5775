import { once } from 'node:events';
import type { Server } from 'node:http';
import type { AddressInfo } from 'node:net';

import express from 'express';
import iconv from 'iconv-lite';

import { errorMiddleware, jsonBody } from '../src/express.js';

const servers: Server[] = [];

afterEach(() => {
  for (const server of servers.splice(0)) {
    server.closeAllConnections();
    server.close();
  }
});

/** A server echoing what `jsonBody('1kb')` left in `req.body` (`"<unset>"` for nothing). */
async function echo(): Promise<string> {
  const app = express();
  app.post('/', jsonBody('1kb'), (req, res) => {
    res.json({ body: req.body === undefined ? '<unset>' : (req.body as unknown) });
  });
  app.use(errorMiddleware());
  const server = app.listen(0, '127.0.0.1');
  servers.push(server);
  await once(server, 'listening');
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}/`;
}

async function post(
  url: string,
  body: string,
  contentType = 'application/json',
): Promise<{ status: number; body: Record<string, unknown> }> {
  const response = await fetch(url, {
    method: 'POST',
    headers: { 'content-type': contentType },
    body,
  });
  return { status: response.status, body: (await response.json()) as Record<string, unknown> };
}

describe('jsonBody', () => {
  test('a JSON body is parsed, an empty one is {}, another content type is left unparsed', async () => {
    const url = await echo();
    expect(await post(url, '{"a":[1,"é"]}')).toEqual({
      status: 200,
      body: { body: { a: [1, 'é'] } },
    });
    expect(await post(url, '{"a":1}', 'application/json; charset=UTF-8')).toEqual({
      status: 200,
      body: { body: { a: 1 } },
    });
    expect(await post(url, '')).toEqual({ status: 200, body: { body: {} } });
    expect(await post(url, '{"a":1}', 'text/plain')).toEqual({
      status: 200,
      body: { body: '<unset>' },
    });
  });

  test('bad JSON and a charset other than UTF-8 are 422 invalid_request; too large a body is 413', async () => {
    const url = await echo();
    const bad = await post(url, '{"a": NaN}');
    expect(bad.status).toBe(422);
    expect(bad.body).toMatchObject({ error: { code: 'invalid_request' } });
    expect((bad.body.error as { detail: string }).detail).toMatch(/not valid JSON/);
    const latin = await post(url, '{"a":1}', 'application/json; charset=latin1');
    expect(latin.status).toBe(422);
    expect((latin.body.error as { detail: string }).detail).toMatch(/charset must be utf-8/);
    const large = await post(url, JSON.stringify({ pad: 'x'.repeat(2048) }));
    expect(large).toEqual({
      status: 413,
      body: { error: { code: 'payload_too_large', detail: 'request body is too large' } },
    });
  });

  // express.json decodes through iconv-lite, whose codec tables load on a process's first body:
  // ~150 ms of CPU inside a fresh server's restore at scale.
  test('parsing a body never loads the iconv-lite codec tables', async () => {
    const url = await echo();
    expect(await post(url, '{"a":1}')).toMatchObject({ status: 200 });
    expect(iconv.encodings).toBeFalsy();
  });
});
