/**
 * Generators of hostile request bodies, as bytes on the wire with their headers: JSON of the wrong
 * shape, deep nesting, huge strings, NaN tokens, duplicate keys, bad UTF-8, wrong content types,
 * unsupported charsets, broken content encodings and absent bodies. Every one is a client's
 * mistake (or, rarely, a valid request): a server must never answer one with a 5xx.
 */
import { brotliCompressSync, deflateSync, gzipSync } from 'node:zlib';

import fc from 'fast-check';

/** A request body as sent: its headers and bytes (an empty buffer when no body is sent). */
export interface HostileBody {
  /** What was done to the body, for a readable counterexample. */
  readonly label: string;
  readonly headers: Readonly<Record<string, string>>;
  readonly bytes: Buffer;
}

const TOKENS = ['NaN', 'Infinity', '-Infinity', 'nan', '1e999', '-0', '1e-400', '0x10', '01', '+1'];

/** `{"field": value}` with a JSON value of any type, or a field the route does not know. */
function wrongTypes(fields: readonly string[]): fc.Arbitrary<string> {
  const field = fc.oneof(fc.constantFrom(...fields), fc.string({ maxLength: 8 }));
  return fc.oneof(
    fc.jsonValue().map((value) => JSON.stringify(value)),
    fc
      .dictionary(field, fc.jsonValue({ maxDepth: 3 }), { maxKeys: 6 })
      .map((value) => JSON.stringify(value)),
  );
}

/** Arrays and objects nested up to 10k levels, closed or left open. */
const deepNesting: fc.Arbitrary<string> = fc
  .tuple(fc.integer({ min: 2, max: 10_000 }), fc.boolean(), fc.boolean())
  .map(([depth, objects, closed]) => {
    const open = objects ? '{"a":' : '[';
    const close = objects ? '}' : ']';
    return open.repeat(depth) + '1' + (closed ? close.repeat(depth) : '');
  });

/** A string value or key of up to 256 KB. */
function hugeStrings(fields: readonly string[]): fc.Arbitrary<string> {
  return fc
    .tuple(fc.constantFrom(...fields), fc.integer({ min: 10_000, max: 1 << 18 }), fc.boolean())
    .map(([field, size, asKey]) => {
      const huge = JSON.stringify('x'.repeat(size));
      return asKey ? `{${huge}:1}` : `{${JSON.stringify(field)}:${huge}}`;
    });
}

/** NaN, Infinity and other tokens JSON does not have, as a field's value or the whole body. */
function badTokens(fields: readonly string[]): fc.Arbitrary<string> {
  return fc
    .tuple(fc.constantFrom(...fields), fc.constantFrom(...TOKENS), fc.boolean())
    .map(([field, token, whole]) => (whole ? token : `{${JSON.stringify(field)}:${token}}`));
}

/** A field given twice (the second value wins in JSON.parse), or a prototype-looking key. */
function duplicateKeys(valid: fc.Arbitrary<Record<string, unknown>>): fc.Arbitrary<string> {
  return fc.oneof(
    fc.tuple(valid, fc.jsonValue({ maxDepth: 1 })).map(([body, value]) => {
      const text = JSON.stringify(body);
      const [first] = Object.keys(body);
      if (first === undefined) return text;
      return `${text.slice(0, -1)},${JSON.stringify(first)}:${JSON.stringify(value)}}`;
    }),
    fc
      .tuple(fc.constantFrom('__proto__', 'constructor', 'prototype'), valid)
      .map(([key, body]) => `{${JSON.stringify(key)}:${JSON.stringify(body)}}`),
  );
}

/** Lone surrogate escapes, truncated text and other near-JSON. */
function nearJson(valid: fc.Arbitrary<Record<string, unknown>>): fc.Arbitrary<string> {
  return fc.oneof(
    valid.chain((body) => {
      const text = JSON.stringify(body);
      return fc.integer({ min: 0, max: text.length - 1 }).map((end) => text.slice(0, end));
    }),
    valid.map((body) => JSON.stringify(body).replace(/"c1"/, '"\\ud800"')),
    fc.string({ maxLength: 40 }),
    fc.constantFrom('', ' ', '\ufeff{}', '{}{}', '[]', 'null', '"', '{"a":1,}', "{'a':1}"),
  );
}

/** Body text for a route with these `fields`, valid bodies among them. */
export function hostileJsonText(
  fields: readonly string[],
  valid: fc.Arbitrary<Record<string, unknown>>,
): fc.Arbitrary<string> {
  return fc.oneof(
    valid.map((body) => JSON.stringify(body)),
    wrongTypes(fields),
    deepNesting,
    hugeStrings(fields),
    badTokens(fields),
    duplicateKeys(valid),
    nearJson(valid),
  );
}

/** Byte sequences that are not UTF-8: stray continuation, truncated, overlong, surrogate, > U+10FFFF. */
const BAD_UTF8 = [
  [0xff],
  [0x80],
  [0xc3],
  [0xc0, 0xaf],
  [0xed, 0xa0, 0x80],
  [0xf4, 0x90, 0x80, 0x80],
];

/** The text as UTF-8, sometimes with bytes that are not UTF-8 spliced in. */
function utf8Bytes(text: string): fc.Arbitrary<{ label: string; bytes: Buffer }> {
  const bytes = Buffer.from(text, 'utf8');
  return fc.oneof(
    fc.constant({ label: 'utf-8', bytes }),
    fc
      .tuple(fc.constantFrom(...BAD_UTF8), fc.integer({ min: 0, max: bytes.length }))
      .map(([bad, at]) => ({
        label: `bad utf-8 ${bad.map((b) => b.toString(16)).join(' ')} at ${at}`,
        bytes: Buffer.concat([bytes.subarray(0, at), Buffer.from(bad), bytes.subarray(at)]),
      })),
  );
}

type Encoder = readonly [
  label: string,
  encoding: string | undefined,
  encode: (b: Buffer) => Buffer,
];

const identity = (bytes: Buffer): Buffer => bytes;
const truncated = (bytes: Buffer): Buffer => bytes.subarray(0, Math.max(1, bytes.length >> 1));

/** Content encodings, valid and broken: truncated streams, garbage, unknown names. */
const ENCODERS: readonly Encoder[] = [
  ['identity', undefined, identity],
  ['identity named', 'identity', identity],
  ['gzip', 'gzip', (b) => gzipSync(b)],
  ['GZIP', 'GZIP', (b) => gzipSync(b)],
  ['gzip truncated', 'gzip', (b) => truncated(gzipSync(b))],
  ['gzip with trailing garbage', 'gzip', (b) => Buffer.concat([gzipSync(b), Buffer.from('xx')])],
  ['plain text named gzip', 'gzip', identity],
  ['deflate', 'deflate', (b) => deflateSync(b)],
  ['garbage named deflate', 'deflate', identity],
  ['deflate truncated', 'deflate', (b) => truncated(deflateSync(b))],
  ['br', 'br', (b) => brotliCompressSync(b)],
  ['garbage named br', 'br', identity],
  ['unknown encoding', 'x-squash', identity],
  ['zstd', 'zstd', identity],
  ['two encodings', 'gzip, deflate', (b) => deflateSync(gzipSync(b))],
];

/** Content types: JSON with and without charsets (some not UTF-8), other types, none, malformed. */
const CONTENT_TYPES: readonly (string | undefined)[] = [
  'application/json',
  'application/json; charset=utf-8',
  'application/json; charset=UTF8',
  'application/json; charset=latin1',
  'application/json; charset=iso-8859-1',
  'application/json; charset=utf-16le',
  'application/json; charset=koi8-r',
  'application/json; charset=x-nonsense',
  'application/json; charset="utf-8"',
  'application/json; charset=',
  'application/json;;',
  'application/json; charset',
  'APPLICATION/JSON',
  'text/plain',
  'application/x-www-form-urlencoded',
  'multipart/form-data; boundary=x',
  'application/octet-stream',
  '',
  undefined,
];

/** Shows a body in a counterexample by its label, headers and first bytes, not every byte. */
function described(body: HostileBody): HostileBody {
  const head = body.bytes.subarray(0, 120).toString('latin1');
  const text = `${body.label} ${JSON.stringify(body.headers)} ${body.bytes.length} bytes: ${head}`;
  return Object.assign(body, { [fc.toStringMethod]: () => text });
}

/** A hostile body for a route with these `fields`, valid bodies (for the encodings) among them. */
export function hostileBody(
  fields: readonly string[],
  valid: fc.Arbitrary<Record<string, unknown>>,
): fc.Arbitrary<HostileBody> {
  const encoded = fc
    .tuple(
      hostileJsonText(fields, valid).chain(utf8Bytes),
      // Half the bodies are plain JSON on the wire, so the text's own flaws are reached too.
      fc.oneof(fc.constant(ENCODERS[0]!), fc.constantFrom(...ENCODERS)),
      fc.oneof(fc.constant(CONTENT_TYPES[0]), fc.constantFrom(...CONTENT_TYPES)),
    )
    .map(([{ label, bytes }, [encoding, name, encode], contentType]) => {
      const headers: Record<string, string> = {};
      if (contentType !== undefined) headers['content-type'] = contentType;
      if (name !== undefined) headers['content-encoding'] = name;
      return described({
        label: `${label}, ${encoding}, ${contentType}`,
        headers,
        bytes: encode(bytes),
      });
    });
  const absent = fc.constantFrom<HostileBody>(
    described({ label: 'no body, no content type', headers: {}, bytes: Buffer.alloc(0) }),
    described({
      label: 'no body',
      headers: { 'content-type': 'application/json' },
      bytes: Buffer.alloc(0),
    }),
    described({
      label: 'no body, gzip',
      headers: { 'content-type': 'application/json', 'content-encoding': 'gzip' },
      bytes: Buffer.alloc(0),
    }),
  );
  return fc.oneof({ arbitrary: encoded, weight: 20 }, { arbitrary: absent, weight: 1 });
}
