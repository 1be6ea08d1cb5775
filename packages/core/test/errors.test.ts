import { readFileSync } from 'node:fs';
import { join } from 'node:path';

import express, { type Request, type Response } from 'express';

import { ERROR_CATALOGUE, errorFromBody, toClientError } from '../src/errors.js';

describe('the error catalogue', () => {
  test('docs/errors.md lists every code with its HTTP status and retry rule, and no code the catalogue lacks', () => {
    const doc = readFileSync(join(import.meta.dirname, '../../../docs/errors.md'), 'utf8');
    const codesTable = doc.slice(doc.indexOf('\n## Codes\n'));
    const rows = new Map(
      [...codesTable.matchAll(/^\| `([a-z_]+)` \| ([^|]+) \| ([^|]+) \|/gm)].map((m) => [
        m[1]!,
        [m[2]!.trim(), m[3]!.trim()],
      ]),
    );
    for (const [code, { status, retry }] of Object.entries(ERROR_CATALOGUE)) {
      // invalid_config never reaches a client: the process exits before it listens.
      const http = code === 'invalid_config' ? '—' : `${status}`;
      expect([code, rows.get(code)]).toEqual([code, [http, retry]]);
    }
    expect([...rows.keys()].filter((code) => !(code in ERROR_CATALOGUE))).toEqual([]);
  });

  test('an upstream reply carrying a ckpt-gym error keeps its code; any other body is a 502 upstream_error', () => {
    const refusal = errorFromBody(409, { error: { code: 'admission_closed', detail: 'closed' } });
    expect([refusal.code, refusal.status, refusal.detail]).toEqual([
      'admission_closed',
      409,
      'closed',
    ]);
    for (const body of [undefined, '<html>bad gateway</html>', { error: { code: 'nope' } }]) {
      const err = errorFromBody(503, body);
      expect([err.code, err.status]).toEqual(['upstream_error', 502]);
      expect(err.detail).toMatch(/^HTTP 503/);
    }
  });

  test('anything unknown reaches a client as internal_error without its message', () => {
    const err = toClientError(new Error('secret path /etc/x'));
    expect(err.toBody()).toEqual({
      error: { code: 'internal_error', detail: 'internal server error' },
    });
  });

  test('a failure to read a request body is a client error: 413 for its size, 422 for anything else', () => {
    // What body-parser and raw-body raise: an HTTP status, and expose: true for a client's fault.
    const bodyError = (status: number, message: string, props: object = {}) =>
      Object.assign(new Error(message), { status, expose: status < 500, ...props });
    const cases: [Error, string, string][] = [
      [
        bodyError(400, 'unexpected end of file', { code: 'Z_BUF_ERROR', errno: -5 }),
        'invalid_request',
        'request body could not be decompressed: unexpected end of file',
      ],
      [
        bodyError(415, 'unsupported content encoding "x"', { type: 'encoding.unsupported' }),
        'invalid_request',
        'request body could not be read: unsupported content encoding "x"',
      ],
      [
        bodyError(415, 'unsupported charset "LATIN1"', { type: 'charset.unsupported' }),
        'invalid_request',
        'request body could not be read: unsupported charset "LATIN1"',
      ],
      [
        bodyError(400, 'request size did not match content length', {
          type: 'request.size.invalid',
        }),
        'invalid_request',
        'request body could not be read: request size did not match content length',
      ],
      [
        bodyError(400, 'Unexpected token', { type: 'entity.parse.failed' }),
        'invalid_request',
        'request body is not valid JSON: Unexpected token',
      ],
      [
        bodyError(413, 'request entity too large', { type: 'entity.too.large' }),
        'payload_too_large',
        'request body is too large',
      ],
      // A server-side failure while reading stays internal.
      [
        bodyError(500, 'stream is not readable', { type: 'stream.not.readable' }),
        'internal_error',
        'internal server error',
      ],
      [Object.assign(new Error('x'), { status: 400 }), 'internal_error', 'internal server error'],
    ];
    for (const [err, code, detail] of cases) {
      const client = toClientError(err);
      expect([err.message, client.code, client.detail]).toEqual([err.message, code, detail]);
    }
  });

  test("express's router refusing a path parameter that is not percent-encoded UTF-8 is 422 invalid_request", async () => {
    const router = express.Router();
    router.get('/rollouts/:id', (_req, res) => res.end());
    for (const id of ['%ZZ', '%ED%A0%80', '%']) {
      // What the router hands the error middleware (its URIError, with status 400).
      const routed = await new Promise<unknown>((resolve) => {
        const req = { method: 'GET', url: `/rollouts/${id}`, headers: {} } as Request;
        router(req, {} as Response, resolve);
      });
      const client = toClientError(routed);
      expect([id, client.code, client.status, client.detail]).toEqual([
        id,
        'invalid_request',
        422,
        `a request path parameter is not percent-encoded UTF-8: Failed to decode param '${id}'`,
      ]);
    }
    // Only the router's: a URIError our own code raises is a bug, not the client's.
    expect(toClientError(new URIError('URI malformed')).code).toBe('internal_error');
  });
});
