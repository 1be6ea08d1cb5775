/**
 * Malformed data-plane requests for the per-route property tests, and the check
 * that a server answered one as a client's mistake: below 500, in the standard JSON error shape.
 *
 * A case starts from a valid body and breaks one thing: a field at any depth dropped, added,
 * duplicated, wrapped or given a wrong value (wrong types, raw NaN/Infinity tokens, lone
 * surrogates, huge strings, nesting a few hundred levels deep, `__proto__` keys); or the body as a
 * whole (another top-level value, empty, truncated, not JSON, invalid UTF-8 bytes, another content
 * type or none).
 *
 * Left out on purpose, as they belong to core's shared body parser and its own tests: broken
 * Content-Encoding, charsets other than UTF-8, nesting thousands of levels deep, oversized headers.
 */
import { Agent, request } from 'node:http';

import { ERROR_CATALOGUE, isErrorCode } from '@ckpt-gym/core/protocol';
import fc from 'fast-check';

export interface RawRequest {
  /** What was broken, for the failure message. */
  readonly what: string;
  readonly body: Buffer;
  /** The Content-Type header; null sends none. */
  readonly contentType: string | null;
}

export interface RawReply {
  readonly status: number;
  readonly contentType: string;
  readonly text: string;
  /** The `Set-Cookie` headers, as sent. */
  readonly cookies: readonly string[];
}

type Path = readonly (string | number)[];
type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

const MARK = '\u0000mark\u0000';
const MARK_TEXT = JSON.stringify(MARK);
const HUGE = 1 << 20;

/** JSON text for values of the wrong type, raw tokens `JSON.parse` refuses or reads oddly. */
export const WRONG_VALUE_TEXT: fc.Arbitrary<string> = fc.oneof(
  fc.constantFrom(
    'null',
    'true',
    'false',
    '0',
    '-1',
    '1.5',
    '-0',
    '9007199254740993',
    '1e308',
    '1e999',
    '-1e999',
    '123456789012345678901234567890',
    'NaN',
    'Infinity',
    '-Infinity',
    'undefined',
    '01',
    '""',
    '" "',
    '"\\ud800"',
    '"a\\udc00b"',
    '"\\udfff\\ud800"',
    '"\\u0000"',
    '"../x"',
    '"a/b?c#d"',
    '"%ff"',
    '"-a1"',
    '[]',
    '[null]',
    '[[]]',
    '{}',
    '{"":null}',
    '{"__proto__":{"polluted":1}}',
    '{"constructor":{"prototype":{"polluted":1}}}',
    '{"toString":1,"valueOf":1}',
  ),
  fc.jsonValue({ maxDepth: 3 }).map((v) => JSON.stringify(v)),
  fc.string({ unit: 'binary' }).map((s) => JSON.stringify(s)),
  fc.constantFrom(64, 512).map((depth) => `${'['.repeat(depth)}${']'.repeat(depth)}`),
  fc.constantFrom(
    JSON.stringify('x'.repeat(HUGE)),
    JSON.stringify('\ud83d\ude00'.repeat(HUGE / 4)),
    `[${'0,'.repeat(100_000)}0]`,
  ),
);

/** Keys a client should not send: unknown, empty, prototype names, very long. */
const EXTRA_KEY = fc.oneof(
  fc.constantFrom(
    '',
    'extra',
    '__proto__',
    'constructor',
    'prototype',
    'toString',
    'valueOf',
    'k'.repeat(10_000),
  ),
  fc.string({ unit: 'binary', minLength: 1, maxLength: 12 }),
);

/** Every path to a value inside `value`, the root (`[]`) included. */
export function pathsOf(value: unknown, at: Path = []): Path[] {
  const out: Path[] = [at];
  if (Array.isArray(value)) {
    value.forEach((v, i) => out.push(...pathsOf(v, [...at, i])));
  } else if (typeof value === 'object' && value !== null) {
    for (const [k, v] of Object.entries(value)) out.push(...pathsOf(v, [...at, k]));
  }
  return out;
}

function getAt(value: Json, path: Path): Json {
  let node = value;
  for (const part of path) node = (node as Record<string | number, Json>)[part]!;
  return node;
}

/** A deep copy of `value` with `edit` applied to the container at `path`'s parent. */
function editAt(
  value: Json,
  path: Path,
  edit: (parent: Record<string | number, Json>, key: string | number) => void,
): Json {
  const copy = structuredClone(value);
  const parent = getAt(copy, path.slice(0, -1)) as Record<string | number, Json>;
  edit(parent, path[path.length - 1]!);
  return copy;
}

/** `valid` as JSON text with the value at `path` (not the root) written as `text`. */
function withTextAt(valid: Json, path: Path, text: string): string {
  const marked = editAt(valid, path, (parent, key) => {
    parent[key] = MARK;
  });
  return JSON.stringify(marked).replace(MARK_TEXT, () => text);
}

/** `valid` with `text` added to the container at `path`: under `key` (an object) or last (a list). */
function addedField(valid: Json, path: Path, key: string, text: string): string {
  const container = getAt(valid, path);
  if (Array.isArray(container)) {
    return withTextAt(valid, [...path, container.length], text);
  }
  const marked = structuredClone(valid);
  const target = getAt(marked, path) as Record<string, Json>;
  // Not `target[key] = …`: `__proto__` must become an own key of the text.
  Object.defineProperty(target, key, { value: MARK, enumerable: true, writable: true });
  return JSON.stringify(marked).replace(MARK_TEXT, () => text);
}

/** A request that fast-check prints as what it is and the start of its body, not every byte. */
function rawRequest(what: string, body: Buffer, contentType: string | null): RawRequest {
  return {
    what,
    body,
    contentType,
    [fc.toStringMethod]: () =>
      `${JSON.stringify(what)} (${contentType ?? 'no content type'}, ${body.length} bytes: ${JSON.stringify(body.subarray(0, 120).toString('utf8'))})`,
  } as RawRequest;
}

function jsonText(what: string, text: string): RawRequest {
  return rawRequest(what, Buffer.from(text, 'utf8'), 'application/json');
}

/** `value` as a well-formed JSON request (a valid call between malformed ones). */
export function jsonRequest(value: unknown, what = 'a valid body'): RawRequest {
  return jsonText(what, JSON.stringify(value));
}

/** `valid` broken at one field, anywhere in it. */
function brokenField(valid: Json, before = ''): fc.Arbitrary<RawRequest> {
  const named = (what: string, text: string) => jsonText(`${before}${what}`, text);
  const all = pathsOf(valid);
  const inner = all.filter((p) => p.length > 0);
  const containers = all.filter((p) => {
    const v = getAt(valid, p);
    return typeof v === 'object' && v !== null;
  });
  const cases: fc.Arbitrary<RawRequest>[] = [];
  if (inner.length > 0) {
    const at = fc.constantFrom(...inner);
    cases.push(
      fc
        .tuple(at, WRONG_VALUE_TEXT)
        .map(([path, text]) =>
          named(`${path.join('.')} := ${text.slice(0, 80)}`, withTextAt(valid, path, text)),
        ),
      at.map((path) =>
        named(
          `${path.join('.')} dropped`,
          JSON.stringify(
            editAt(valid, path, (parent, key) => {
              if (Array.isArray(parent)) parent.splice(Number(key), 1);
              else delete parent[key];
            }),
          ),
        ),
      ),
      at.map((path) =>
        named(
          `${path.join('.')} wrapped in a list`,
          withTextAt(valid, path, `[${JSON.stringify(getAt(valid, path))}]`),
        ),
      ),
      // JSON.parse keeps the last of duplicate keys; a parser that kept the first would differ.
      fc.tuple(fc.tuple(at, WRONG_VALUE_TEXT), fc.boolean()).map(([[path, text], wrongFirst]) => {
        const original = JSON.stringify(getAt(valid, path));
        const key = JSON.stringify(String(path[path.length - 1]));
        const twice = wrongFirst ? `${text},${key}:${original}` : `${original},${key}:${text}`;
        const parent = getAt(valid, path.slice(0, -1));
        return named(
          `${path.join('.')} duplicated (${wrongFirst ? 'wrong first' : 'wrong last'})`,
          withTextAt(valid, path, Array.isArray(parent) ? text : twice),
        );
      }),
    );
  }
  cases.push(
    fc
      .tuple(fc.constantFrom(...containers), EXTRA_KEY, WRONG_VALUE_TEXT)
      .map(([path, key, text]) =>
        named(
          `${path.join('.') || '(body)'} + ${JSON.stringify(key.slice(0, 20))}: ${text.slice(0, 40)}`,
          addedField(valid, path, key, text),
        ),
      ),
  );
  return fc.oneof(...cases);
}

/** Text that is not one JSON value (truncated, trailing junk, random). */
function notJson(validText: string): fc.Arbitrary<RawRequest> {
  const parses = (s: string) => {
    try {
      JSON.parse(s);
      return true;
    } catch {
      return false;
    }
  };
  return fc
    .oneof(
      fc.nat(Math.max(validText.length - 1, 0)).map((n) => validText.slice(0, n)),
      fc.constantFrom(`${validText}}`, `${validText},`, `${validText} x`, `\ufeff${validText}`),
      fc.constantFrom('{', '{"a":}', "{'a':1}", '{"a":1,}', '[1,]', 'nul', '{"a" 1}'),
      fc.string({ unit: 'binary', maxLength: 40 }),
    )
    .filter((s) => s.trim() !== '' && !parses(s))
    .map((s) => jsonText(`not JSON: ${s.slice(0, 60)}`, s));
}

/** The body as a whole replaced, or sent with another content type. */
function brokenWhole(validText: string): fc.Arbitrary<RawRequest> {
  const otherTop = fc
    .constantFrom('null', '[]', '[{}]', '5', '-1e999', '"text"', 'true', '{}', '""', '[null]')
    .map((t) => jsonText(`body := ${t}`, t));
  const empty = fc
    .constantFrom('', ' ', '\n\t')
    .map((t) => jsonText(`empty body ${JSON.stringify(t)}`, t));
  const contentType = fc
    .constantFrom(
      null,
      'text/plain',
      'application/x-www-form-urlencoded',
      'multipart/form-data; boundary=x',
      'application/octet-stream',
      'application/vnd.api+json',
      'application/json; charset=utf-8',
      'APPLICATION/JSON',
      'application/json;',
      'json',
    )
    .chain((type) =>
      fc
        .constantFrom(validText, '', 'a=1&b=2')
        .map((text) =>
          rawRequest(
            `content-type ${String(type)} with ${JSON.stringify(text.slice(0, 30))}`,
            Buffer.from(text, 'utf8'),
            type,
          ),
        ),
    );
  // Bytes that are no UTF-8 at all, inside a string of an otherwise valid body.
  const badUtf8 = fc
    .constantFrom(
      Buffer.from([0xff]),
      Buffer.from([0xc3]),
      Buffer.from([0xed, 0xa0, 0x80]),
      Buffer.from([0xf8, 0x88, 0x80, 0x80, 0x80]),
    )
    .map((bytes) => {
      const at = validText.indexOf('"') + 1;
      return rawRequest(
        `invalid UTF-8 bytes ${bytes.toString('hex')} in the body`,
        Buffer.concat([
          Buffer.from(validText.slice(0, at)),
          bytes,
          Buffer.from(validText.slice(at)),
        ]),
        'application/json',
      );
    });
  return fc.oneof(otherTop, empty, contentType, badUtf8, notJson(validText));
}

/** Small values of other types, for a first change before `brokenField` breaks another field. */
const OTHER_VALUE: fc.Arbitrary<Json> = fc.oneof(
  fc.constantFrom<Json>(null, true, 0, -1, 1.5, '', '\ud800', [], {}, [null], { a: 1 }),
  fc.jsonValue({ maxDepth: 2 }) as fc.Arbitrary<Json>,
);

/** `valid` with one field, anywhere in it, dropped or given another value, and what changed. */
function changedOnce(valid: Json): fc.Arbitrary<[Json, string]> {
  const inner = pathsOf(valid).filter((p) => p.length > 0);
  if (inner.length === 0) return fc.constant([valid, '']);
  return fc.tuple(fc.constantFrom(...inner), fc.option(OTHER_VALUE)).map(([path, value]) => [
    editAt(valid, path, (parent, key) => {
      if (value !== null) parent[key] = value;
      else if (Array.isArray(parent)) parent.splice(Number(key), 1);
      else delete parent[key];
    }),
    `${path.join('.')} ${value === null ? 'dropped' : `:= ${JSON.stringify(value).slice(0, 40)}`}, then `,
  ]);
}

/** One malformed request built from `body`, a JSON object the route accepts. */
export function malformedRequest(body: object): fc.Arbitrary<RawRequest> {
  const valid = body as Json;
  const text = JSON.stringify(valid);
  return fc.oneof(
    { arbitrary: brokenField(valid), weight: 4 },
    { arbitrary: changedOnce(valid).chain(([value, what]) => brokenField(value, what)), weight: 2 },
    { arbitrary: brokenWhole(text), weight: 1 },
  );
}

const agent = new Agent({ keepAlive: true, maxSockets: 8 });

/** Sends `raw` as a POST (or `method`) to `url` on a keep-alive connection. */
export function send(
  url: string,
  raw: RawRequest | null,
  options: { method?: string; headers?: Record<string, string> } = {},
): Promise<RawReply> {
  return new Promise((resolve, fail) => {
    const reject = (err: Error) =>
      fail(new Error(`${raw?.what ?? 'no body'}: no reply a client can read (${err.message})`));
    const headers: Record<string, string | number> = { ...options.headers };
    if (raw?.contentType) headers['content-type'] = raw.contentType;
    if (raw) headers['content-length'] = raw.body.length;
    const req = request(url, { method: options.method ?? 'POST', headers, agent }, (res) => {
      const chunks: Buffer[] = [];
      res.on('data', (chunk: Buffer) => chunks.push(chunk));
      res.on('error', reject);
      res.on('end', () =>
        resolve({
          status: res.statusCode ?? 0,
          contentType: res.headers['content-type'] ?? '',
          text: Buffer.concat(chunks).toString('utf8'),
          cookies: res.headers['set-cookie'] ?? [],
        }),
      );
    });
    req.on('error', reject);
    req.end(raw?.body);
  });
}

/** Ends the keep-alive connections `send` kept (call in afterAll). */
export function closeConnections(): void {
  agent.destroy();
}

/**
 * Why `reply` is not a client error or success in the standard shape, or undefined when it is:
 * below 500, JSON, and an error reply is `{"error": {"code", "detail"}}` with a catalogue code
 * whose status it carries.
 */
export function replyProblem(reply: RawReply): string | undefined {
  if (reply.status >= 500) return `a ${reply.status}`;
  if (reply.status < 400) return undefined;
  if (!reply.contentType.startsWith('application/json')) return `content-type ${reply.contentType}`;
  let body: { error?: { code?: unknown; detail?: unknown } };
  try {
    body = JSON.parse(reply.text) as typeof body;
  } catch {
    return 'a body that is not JSON';
  }
  const code = body.error?.code;
  if (!isErrorCode(code)) return `error code ${JSON.stringify(code)} is not in the catalogue`;
  if (typeof body.error?.detail !== 'string') return 'no string error.detail';
  if (ERROR_CATALOGUE[code].status !== reply.status) {
    return `status ${reply.status} is not ${code}'s ${ERROR_CATALOGUE[code].status}`;
  }
  return undefined;
}

/** Fails naming the case and the reply when `reply` is not a client error or success. */
export function expectClientOutcome(raw: RawRequest | null, reply: RawReply): void {
  const problem = replyProblem(reply);
  if (problem !== undefined) {
    throw new Error(
      `${raw?.what ?? 'no body'}: ${problem}\n  body: ${raw?.body.toString('utf8').slice(0, 300) ?? ''}\n  reply ${reply.status}: ${reply.text.slice(0, 300)}`,
    );
  }
}

/**
 * fast-check parameters: `numRuns` (times `ROUTE_FUZZ_SCALE`, to fuzz harder by hand), or a replay
 * of `ROUTE_FUZZ_SEED` (and `ROUTE_FUZZ_PATH`) as a failure reports them.
 */
export function fuzzParameters<T>(numRuns: number): fc.Parameters<T> {
  const seed = process.env.ROUTE_FUZZ_SEED;
  const path = process.env.ROUTE_FUZZ_PATH;
  const scale = Number(process.env.ROUTE_FUZZ_SCALE ?? 1);
  return {
    numRuns: Math.max(1, Math.round(numRuns * scale)),
    ...(seed ? { seed: Number(seed) } : {}),
    ...(path ? { path } : {}),
  };
}
