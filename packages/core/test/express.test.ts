import { once } from 'node:events';
import type { Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { brotliCompressSync, deflateSync, gzipSync } from 'node:zlib';

import express from 'express';
import iconv from 'iconv-lite';

import { errorMiddleware, jsonBody, MAX_JSON_BODY_DEPTH } from '../src/express.js';
import { nestsDeeperThan } from '../src/json-pieces.js';

const servers: Server[] = [];

afterEach(() => {
  for (const server of servers.splice(0)) {
    server.closeAllConnections();
    server.close();
  }
});

/** A server echoing what `jsonBody(limit)` left in `req.body` (`"<unset>"` for nothing). */
async function echo(limit = '1kb'): Promise<string> {
  const app = express();
  app.post('/', jsonBody(limit), (req, res) => {
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

async function postBytes(
  url: string,
  bytes: Uint8Array,
  headers: Record<string, string>,
): Promise<{ status: number; body: Record<string, unknown> }> {
  const response = await fetch(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: bytes,
  });
  return { status: response.status, body: (await response.json()) as Record<string, unknown> };
}

function nested(depth: number, open = '[', close = ']'): string {
  return open.repeat(depth) + '1' + close.repeat(depth);
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

  test('a body whose content encoding does not decompress or is unknown is 422 invalid_request; a valid one parses', async () => {
    const url = await echo();
    const text = Buffer.from('{"a":[1,"é"]}');
    for (const [encoding, bytes] of [
      ['gzip', gzipSync(text)],
      ['deflate', deflateSync(text)],
      ['br', brotliCompressSync(text)],
    ] as const) {
      expect([encoding, await postBytes(url, bytes, { 'content-encoding': encoding })]).toEqual([
        encoding,
        { status: 200, body: { body: { a: [1, 'é'] } } },
      ]);
    }
    for (const [encoding, bytes, detail] of [
      // Under jest's VM, http-errors replaces zlib's message ("unexpected end of file").
      ['gzip', gzipSync(text).subarray(0, 12), 'could not be decompressed'],
      ['deflate', Buffer.from('not deflate'), 'could not be decompressed'],
      ['br', Buffer.from('not brotli at all'), 'could not be decompressed'],
      ['x-squash', text, 'could not be read: unsupported content encoding "x-squash"'],
    ] as const) {
      const reply = await postBytes(url, bytes, { 'content-encoding': encoding });
      expect([encoding, reply.status, reply.body.error]).toEqual([
        encoding,
        422,
        { code: 'invalid_request', detail: expect.stringContaining(detail) },
      ]);
    }
  });

  test(`a body nesting deeper than ${MAX_JSON_BODY_DEPTH} levels is 422 invalid_request; brackets in strings do not count`, async () => {
    const url = await echo('1mb');
    for (const text of [nested(10_000), nested(10_000, '{"a":', '}'), '['.repeat(10_000)]) {
      expect(await post(url, text)).toEqual({
        status: 422,
        body: {
          error: {
            code: 'invalid_request',
            detail: `request body nests deeper than ${MAX_JSON_BODY_DEPTH} levels of arrays and objects`,
          },
        },
      });
    }
    expect((await post(url, nested(MAX_JSON_BODY_DEPTH))).status).toBe(200);
    expect((await post(url, nested(MAX_JSON_BODY_DEPTH + 1))).status).toBe(422);
    const inString = JSON.stringify({ a: '['.repeat(10_000), b: '\\"[[' });
    expect(await post(url, inString)).toEqual({
      status: 200,
      body: { body: JSON.parse(inString) },
    });
  });

  test('nestsDeeperThan counts arrays and objects, and skips strings and their escapes', () => {
    expect(nestsDeeperThan(Buffer.from('[{"a":[1]}]'), 3)).toBe(false);
    expect(nestsDeeperThan(Buffer.from('[{"a":[1]}]'), 2)).toBe(true);
    expect(nestsDeeperThan(Buffer.from('[[],[],[],[]]'), 2)).toBe(false);
    expect(nestsDeeperThan(Buffer.from('["[[[", "\\"[[[", "\\\\", [1]]'), 2)).toBe(false);
    expect(nestsDeeperThan(Buffer.from('["\\\\", [[1]]]'), 2)).toBe(true);
    expect(nestsDeeperThan(Buffer.from('{"é[[[":"ü{{{"}'), 1)).toBe(false);
  });

  test('bytes that are not UTF-8 are 422 invalid_request, not replaced with U+FFFD', async () => {
    const url = await echo();
    for (const bad of [[0xff], [0xc3], [0xc0, 0xaf], [0xed, 0xa0, 0x80]]) {
      const bytes = Buffer.concat([Buffer.from('{"a":"'), Buffer.from(bad), Buffer.from('"}')]);
      expect([bad, await postBytes(url, bytes, {})]).toEqual([
        bad,
        {
          status: 422,
          body: { error: { code: 'invalid_request', detail: 'request body is not valid UTF-8' } },
        },
      ]);
    }
  });
});
