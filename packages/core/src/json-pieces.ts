/**
 * JSON in pieces, for the record store. Records run to hundreds of KB, and a V8 string that large
 * is a large-object allocation on fresh pages: on a VM where new pages are slow, building one
 * string per record costs more than encoding or parsing it. These functions write and read the
 * same text as `encodeJson` / `decodeJson` while building no string much longer than a piece: the
 * containers near the top of a large value are walked here, everything smaller goes through the
 * codec, so the codec stays the one place that decides what JSON means.
 */
import {
  decodeJson,
  encodeJson,
  encodeJsonWithin,
  JsonDecodeError,
  JsonEncodeError,
  jsonKeys,
  type JsonObject,
  type JsonValue,
} from './json.js';

/** Receives encoded text in order. */
export interface TextSink {
  put(text: string): void;
}

/** Containers shallower than this are written child by child; deeper ones in one codec call. */
const ENCODE_SPLIT_DEPTH = 4;
/**
 * A container whose text is at most about this long is written in one codec call: a record of a
 * few KB is one piece, not one per member (the text may be a few times this where strings need
 * escapes, still far below a large-object allocation).
 */
const WHOLE_CHARS = 1 << 13;
/** Characters of a long string escaped per piece. */
const STRING_PIECE_CHARS = 1 << 15;

/**
 * Writes `encodeJson(value)` to `out` in pieces. A value the codec cannot write throws its
 * `JsonEncodeError`, with the path measured from `value`. `wholeChars` is `WHOLE_CHARS` except
 * in tests.
 */
export function encodeJsonPieces(value: unknown, out: TextSink, wholeChars = WHOLE_CHARS): void {
  const path: (string | number)[] = [];
  try {
    encodeValue(value, 0, path, out, wholeChars);
  } catch (err) {
    if (!(err instanceof JsonEncodeError) || path.length === 0) throw err;
    // The codec saw only the piece at `path`: re-root its path at `value`.
    const where = jsonPath(path) + err.path.slice(1);
    const prefix = 'cannot encode ';
    const suffix = ` at ${err.path}`;
    const what =
      err.message.startsWith(prefix) && err.message.endsWith(suffix)
        ? err.message.slice(prefix.length, -suffix.length)
        : err.message;
    throw new JsonEncodeError(what, where);
  }
}

function encodeValue(
  value: unknown,
  depth: number,
  path: (string | number)[],
  out: TextSink,
  wholeChars: number,
): void {
  if (typeof value === 'string') {
    encodeString(value, out);
    return;
  }
  const splittable = depth < ENCODE_SPLIT_DEPTH && (Array.isArray(value) || isPlainObject(value));
  // Also what refuses anything that is not JSON.
  const whole = splittable ? encodeJsonWithin(value, wholeChars) : encodeJson(value);
  if (whole !== undefined) {
    out.put(whole);
  } else if (Array.isArray(value)) {
    out.put('[');
    for (let i = 0; i < value.length;) {
      if (i > 0) out.put(',');
      const run = scalarRunEnd(value, i);
      if (run > i + 1) {
        // A run of numbers (token ids, say) in one call, not one call per number.
        out.put(encodeJson(value.slice(i, run)).slice(1, -1));
        i = run;
        continue;
      }
      path.push(i);
      encodeValue(value[i], depth + 1, path, out, wholeChars);
      path.pop();
      i += 1;
    }
    out.put(']');
  } else {
    const object = value as Record<string, unknown>; // only a plain object is left unwritten here
    out.put('{');
    const keys = jsonKeys(object);
    for (let i = 0; i < keys.length; i++) {
      const key = keys[i] as string;
      out.put(`${i > 0 ? ',' : ''}${JSON.stringify(key)}:`);
      path.push(key);
      encodeValue(object[key], depth + 1, path, out, wholeChars);
      path.pop();
    }
    out.put('}');
  }
}

/** Elements written together at most. */
const SCALAR_RUN = 4096;

/** The end of the run of numbers, bigints, booleans and nulls from `start` (which never fail to encode). */
function scalarRunEnd(array: readonly unknown[], start: number): number {
  const limit = Math.min(array.length, start + SCALAR_RUN);
  let i = start;
  while (i < limit && i in array) {
    const item = array[i];
    const type = typeof item;
    if (type !== 'number' && type !== 'bigint' && type !== 'boolean' && item !== null) break;
    i++;
  }
  return i;
}

/** The codec's rule for a plain object: the prototype is null or some realm's Object.prototype. */
function isPlainObject(value: unknown): value is Record<string, unknown> {
  if (typeof value !== 'object' || value === null) return false;
  const proto: unknown = Object.getPrototypeOf(value);
  return proto === null || Object.getPrototypeOf(proto) === null;
}

/** `JSON.stringify(text)`, written in pieces that never split a surrogate pair. */
function encodeString(text: string, out: TextSink): void {
  if (text.length <= STRING_PIECE_CHARS) {
    out.put(JSON.stringify(text));
    return;
  }
  out.put('"');
  for (let start = 0; start < text.length;) {
    let end = Math.min(start + STRING_PIECE_CHARS, text.length);
    const last = text.charCodeAt(end - 1);
    if (end < text.length && last >= 0xd800 && last <= 0xdbff) end -= 1;
    out.put(JSON.stringify(text.slice(start, end)).slice(1, -1));
    start = end;
  }
  out.put('"');
}

const IDENTIFIER = /^[A-Za-z_$][\w$]*$/;

/** `$.session.messages[3]`, in the codec's notation. */
function jsonPath(path: readonly (string | number)[]): string {
  let text = '$';
  for (const step of path) {
    if (typeof step === 'number') text += `[${step}]`;
    else text += IDENTIFIER.test(step) ? `.${step}` : `[${JSON.stringify(step)}]`;
  }
  return text;
}

// --- decoding -------------------------------------------------------------------------------------

/** Bytes decoded by one codec call at most (below V8's large-object size). */
export const DECODE_PIECE_BYTES = 1 << 16;
/** Large containers nested deeper than this are decoded whole rather than split further. */
const DECODE_SPLIT_DEPTH = 64;

const QUOTE = 0x22;
const BACKSLASH = 0x5c;
const COMMA = 0x2c;
const COLON = 0x3a;
const OPEN_BRACE = 0x7b;
const CLOSE_BRACE = 0x7d;
const OPEN_BRACKET = 0x5b;
const CLOSE_BRACKET = 0x5d;

/**
 * True when JSON text nests arrays and objects deeper than `limit` (brackets inside strings do not
 * count). One pass over the bytes, before anything recursive sees the value. In UTF-8 every byte of
 * a multi-byte character is >= 0x80, so none is mistaken for a quote, backslash or bracket.
 */
export function nestsDeeperThan(bytes: Uint8Array, limit: number): boolean {
  let depth = 0;
  for (let i = 0; i < bytes.length; i++) {
    const byte = bytes[i];
    if (byte === QUOTE) {
      // Skip the string in a tight loop: most of a large body is strings.
      for (i++; i < bytes.length && bytes[i] !== QUOTE; i++) {
        if (bytes[i] === BACKSLASH) i++;
      }
    } else if (byte === OPEN_BRACKET || byte === OPEN_BRACE) {
      if (++depth > limit) return true;
    } else if (byte === CLOSE_BRACKET || byte === CLOSE_BRACE) {
      depth--;
    }
  }
  return false;
}

function isWhitespace(byte: number | undefined): boolean {
  return byte === 0x20 || byte === 0x0a || byte === 0x0d || byte === 0x09;
}

/**
 * Decodes the UTF-8 JSON text in `bytes[start, end)` to what `decodeJson` gives for it as a
 * string, and refuses exactly the texts it refuses. The caller checks the bytes are UTF-8.
 * A large container is split into its members, which are decoded in batches of at most
 * `pieceBytes`, so no string of the whole text is built. `JsonDecodeError.position` is a byte
 * offset from `start` (for a problem inside a piece, the piece's own offset).
 */
export function decodeJsonPieces(
  bytes: Buffer,
  start = 0,
  end = bytes.length,
  pieceBytes = DECODE_PIECE_BYTES,
): JsonValue {
  let first = start;
  let stop = end;
  while (first < stop && isWhitespace(bytes[first])) first++;
  while (stop > first && isWhitespace(bytes[stop - 1])) stop--;
  return new PieceDecoder(bytes, start, pieceBytes).decode(first, stop, 0);
}

/** A member of an object's text: its key and where its value's text lies. */
export interface ObjectMember {
  /** The key as written (quoted, escapes as in the text). */
  keyText: string;
  key: string;
  start: number;
  end: number;
}

/**
 * The members of the UTF-8 JSON object text in `bytes[start, end)` (whitespace around it
 * allowed), values located but not decoded: a record's fields can then be decoded one by one.
 * Throws `JsonDecodeError` where the text is not an object; a value's own text is checked only
 * when it is decoded (`decodeJsonPieces` of its range).
 */
export function objectMembers(bytes: Buffer, start = 0, end = bytes.length): ObjectMember[] {
  let first = start;
  let stop = end;
  while (first < stop && isWhitespace(bytes[first])) first++;
  while (stop > first && isWhitespace(bytes[stop - 1])) stop--;
  return new PieceDecoder(bytes, start, DECODE_PIECE_BYTES).members(first, stop);
}

/**
 * `objectMembers` of the members ahead of the first one keyed any of `names` (undefined when none
 * is): nothing from that member on is scanned, so small fields written ahead of a large payload
 * are read without walking it. A later duplicate of a member read here is not seen.
 */
export function objectMembersBefore(
  bytes: Buffer,
  names: readonly string[],
): ObjectMember[] | undefined {
  let first = 0;
  while (first < bytes.length && isWhitespace(bytes[first])) first++;
  return new PieceDecoder(bytes, 0, DECODE_PIECE_BYTES).membersBefore(first, bytes.length, names);
}

/**
 * Where each element of the UTF-8 JSON array text in `bytes[start, end)` lies, as `objectMembers`
 * locates an object's values: checked for structure only, each element's text decoded by no one.
 */
export function arrayElements(
  bytes: Buffer,
  start = 0,
  end = bytes.length,
): { start: number; end: number }[] {
  let first = start;
  let stop = end;
  while (first < stop && isWhitespace(bytes[first])) first++;
  while (stop > first && isWhitespace(bytes[stop - 1])) stop--;
  return new PieceDecoder(bytes, start, DECODE_PIECE_BYTES).elements(first, stop);
}

interface Member {
  key: string;
  start: number;
  end: number;
  /** A container too large for one piece: decoded by splitting it in turn. */
  split: boolean;
}

class PieceDecoder {
  constructor(
    private readonly bytes: Buffer,
    private readonly origin: number,
    private readonly pieceBytes: number,
  ) {}

  /** The value that is exactly `[start, stop)`. */
  decode(start: number, stop: number, depth: number): JsonValue {
    const open = this.bytes[start];
    const splits = stop - start > this.pieceBytes && depth < DECODE_SPLIT_DEPTH;
    if (splits && open === OPEN_BRACKET) return this.decodeArray(start, stop, depth);
    if (splits && open === OPEN_BRACE) return this.decodeObject(start, stop, depth);
    return this.decodeText(start, stop, '', '');
  }

  private decodeText(start: number, stop: number, before: string, after: string): JsonValue {
    const text = before + this.bytes.toString('utf8', start, stop) + after;
    try {
      return decodeJson(text);
    } catch (err) {
      if (!(err instanceof JsonDecodeError)) throw err;
      throw new JsonDecodeError(`${err.message} in the piece`, start - this.origin);
    }
  }

  private decodeArray(start: number, stop: number, depth: number): JsonValue[] {
    const result: JsonValue[] = [];
    // A batch is a run of small elements, decoded together as one array text.
    let batchStart = -1;
    let batchEnd = -1;
    const flush = () => {
      if (batchStart < 0) return;
      for (const item of this.decodeText(batchStart, batchEnd, '[', ']') as JsonValue[]) {
        result.push(item);
      }
      batchStart = -1;
    };
    this.items(start, stop, OPEN_BRACKET, (pos) => {
      const valueEnd = this.valueEnd(pos, stop);
      if (valueEnd - pos > this.pieceBytes && this.isContainer(pos)) {
        flush();
        result.push(this.decode(pos, valueEnd, depth + 1));
      } else {
        if (batchStart >= 0 && valueEnd - batchStart > this.pieceBytes) flush();
        if (batchStart < 0) batchStart = pos;
        batchEnd = valueEnd;
      }
      return valueEnd;
    });
    flush();
    return result;
  }

  /**
   * A large object: a skeleton text of its keys and small values (a placeholder for the others)
   * is decoded by the codec, so key order, `__proto__` and duplicate keys behave exactly as there;
   * then the values left out are decoded and set in place.
   */
  private decodeObject(start: number, stop: number, depth: number): JsonObject {
    const skeleton: string[] = [];
    let skeletonBytes = 0;
    const deferred = new Map<string, Member>(); // by key: a later duplicate replaces the value
    for (const { keyText, key, start: valueStart, end: valueEnd } of this.members(start, stop)) {
      const size = valueEnd - valueStart;
      deferred.delete(key);
      if (size + skeletonBytes <= this.pieceBytes) {
        skeleton.push(`${keyText}:${this.bytes.toString('utf8', valueStart, valueEnd)}`);
        skeletonBytes += keyText.length + size + 2;
      } else {
        skeleton.push(`${keyText}:0`);
        skeletonBytes += keyText.length + 3;
        const split = size > this.pieceBytes && this.isContainer(valueStart);
        deferred.set(key, { key, start: valueStart, end: valueEnd, split });
      }
    }
    if (skeleton.length === 0) return {};
    const object = decodeJson(`{${skeleton.join(',')}}`) as JsonObject;
    for (const member of deferred.values()) {
      // Assignment keeps the key's place, and writes an own `__proto__` the codec created.
      object[member.key] = member.split
        ? this.decode(member.start, member.end, depth + 1)
        : this.decodeText(member.start, member.end, '', '');
    }
    return object;
  }

  /**
   * Walks the container that is exactly `[start, stop)` (opened by `open`): `item` reads each
   * item starting at its first byte and returns where it ends; separators and the close checked.
   */
  private items(start: number, stop: number, open: number, item: (pos: number) => number): void {
    const close = open === OPEN_BRACKET ? CLOSE_BRACKET : CLOSE_BRACE;
    if (this.bytes[start] !== open) {
      throw this.error(open === OPEN_BRACKET ? 'expected an array' : 'expected an object', start);
    }
    let pos = this.skipWhitespace(start + 1, stop);
    if (this.bytes[pos] !== close) {
      for (;;) {
        pos = this.skipWhitespace(item(pos), stop);
        if (this.bytes[pos] === COMMA) {
          pos = this.skipWhitespace(pos + 1, stop);
          continue;
        }
        if (this.bytes[pos] === close) break;
        throw this.error(`expected ',' or '${String.fromCharCode(close)}'`, pos);
      }
    }
    this.closed(pos, stop, null);
  }

  /** The elements of the array that is exactly `[start, stop)`, in order, not decoded. */
  elements(start: number, stop: number): { start: number; end: number }[] {
    const elements: { start: number; end: number }[] = [];
    this.items(start, stop, OPEN_BRACKET, (pos) => {
      const end = this.valueEnd(pos, stop);
      elements.push({ start: pos, end });
      return end;
    });
    return elements;
  }

  /** The members of the object that is exactly `[start, stop)`, in order, values not decoded. */
  members(start: number, stop: number): ObjectMember[] {
    const members: ObjectMember[] = [];
    this.items(start, stop, OPEN_BRACE, (pos) => {
      const member = this.member(pos, stop);
      members.push(member);
      return member.end;
    });
    return members;
  }

  /**
   * The members of the object opening at `start` up to the first keyed any of `names` (not
   * scanned), or undefined when no member is.
   */
  membersBefore(start: number, stop: number, names: readonly string[]): ObjectMember[] | undefined {
    if (this.bytes[start] !== OPEN_BRACE) throw this.error('expected an object', start);
    const members: ObjectMember[] = [];
    let pos = this.skipWhitespace(start + 1, stop);
    if (this.bytes[pos] === CLOSE_BRACE) return undefined;
    for (;;) {
      const member = this.member(pos, stop);
      if (names.includes(member.key)) return members;
      members.push(member);
      pos = this.skipWhitespace(member.end, stop);
      if (this.bytes[pos] === CLOSE_BRACE) return undefined;
      if (this.bytes[pos] !== COMMA) throw this.error("expected ',' or '}'", pos);
      pos = this.skipWhitespace(pos + 1, stop);
    }
  }

  /** The member whose key opens at `pos`: its key, and where its value lies. */
  private member(pos: number, stop: number): ObjectMember {
    if (this.bytes[pos] !== QUOTE) throw this.error('expected a string key', pos);
    const keyEnd = this.stringEnd(pos, stop);
    const keyText = this.bytes.toString('utf8', pos, keyEnd);
    const key = this.keyOf(keyText, pos);
    const colon = this.skipWhitespace(keyEnd, stop);
    if (this.bytes[colon] !== COLON) throw this.error("expected ':'", colon);
    const valueStart = this.skipWhitespace(colon + 1, stop);
    return { keyText, key, start: valueStart, end: this.valueEnd(valueStart, stop) };
  }

  /** A key as the codec reads it (validating its escapes). */
  private keyOf(keyText: string, at: number): string {
    try {
      return decodeJson(keyText) as string;
    } catch (err) {
      if (!(err instanceof JsonDecodeError)) throw err;
      throw new JsonDecodeError(`invalid key: ${err.message}`, at - this.origin);
    }
  }

  /** Checks the container's closing byte at `pos` is the last byte of its text. */
  private closed<T>(pos: number, stop: number, value: T): T {
    if (pos !== stop - 1) throw this.error('unexpected text after the JSON value', pos + 1);
    return value;
  }

  private isContainer(pos: number): boolean {
    const byte = this.bytes[pos];
    return byte === OPEN_BRACE || byte === OPEN_BRACKET;
  }

  /** The end of the value starting at `pos`: brackets matched, strings skipped, nothing decoded. */
  private valueEnd(pos: number, stop: number): number {
    const { bytes } = this;
    const first = bytes[pos];
    if (first === QUOTE) return this.stringEnd(pos, stop);
    if (first === OPEN_BRACE || first === OPEN_BRACKET) {
      let depth = 0;
      for (let i = pos; i < stop; i++) {
        const byte = bytes[i];
        if (byte === QUOTE) {
          i = this.stringEnd(i, stop) - 1;
        } else if (byte === OPEN_BRACE || byte === OPEN_BRACKET) {
          depth++;
        } else if ((byte === CLOSE_BRACE || byte === CLOSE_BRACKET) && --depth === 0) {
          return i + 1;
        }
      }
      throw this.error('unterminated container', pos);
    }
    let i = pos;
    while (i < stop) {
      const byte = bytes[i];
      if (byte === COMMA || byte === CLOSE_BRACE || byte === CLOSE_BRACKET || isWhitespace(byte))
        break;
      i++;
    }
    if (i === pos) throw this.error('expected a JSON value', pos);
    return i;
  }

  /** The end (after the closing quote) of the string opening at `pos`. */
  private stringEnd(pos: number, stop: number): number {
    const { bytes } = this;
    for (let from = pos + 1; ;) {
      const quote = bytes.indexOf(QUOTE, from);
      if (quote === -1 || quote >= stop) throw this.error('unterminated string', pos);
      let backslashes = 0;
      while (bytes[quote - 1 - backslashes] === BACKSLASH) backslashes++;
      if (backslashes % 2 === 0) return quote + 1;
      from = quote + 1;
    }
  }

  private skipWhitespace(pos: number, stop: number): number {
    while (pos < stop && isWhitespace(this.bytes[pos])) pos++;
    return pos;
  }

  private error(problem: string, pos: number): JsonDecodeError {
    return new JsonDecodeError(problem, pos - this.origin);
  }
}

// --- encoded once -----------------------------------------------------------------------------------

/** UTF-8 JSON of values that never change, encoded once (`encodeOnce`). */
const ENCODED_ONCE = new WeakMap<object, Buffer>();
/**
 * The items of append-only arrays (`appendEncoded`, `appendOnly`), each item's UTF-8 JSON by index
 * after a `,` (one piece per item; the first is written without it), or undefined: not encoded
 * yet, or the codec refused it and `encodeJsonBytes` will say why.
 */
const APPENDED = new WeakMap<readonly unknown[], (Buffer | undefined)[]>();

/** `prefix` then `encodeJson(value)`, as UTF-8 (throws as `encodeJsonBytes`). */
function utf8Json(value: unknown, prefix = ''): Buffer {
  const pieces = encodeJsonBytes(value);
  const only = pieces.length === 1 ? pieces[0] : undefined;
  if (typeof only === 'string') return Buffer.from(prefix + only);
  const parts = pieces.map((p) => (typeof p === 'string' ? Buffer.from(p) : p));
  return Buffer.concat(prefix === '' ? parts : [Buffer.from(prefix), ...parts]);
}

/** `utf8Json`, or undefined when the codec refuses the value. */
function utf8JsonOrUndefined(value: unknown, prefix = ''): Buffer | undefined {
  try {
    return utf8Json(value, prefix);
  } catch (err) {
    if (err instanceof JsonEncodeError) return undefined;
    throw err;
  }
}

/**
 * Encodes `value` now and keeps its UTF-8 JSON with it: `encodeJsonBytes` writes those bytes
 * wherever it meets the value. The value must never change afterwards. A scalar, or a value the
 * codec refuses, is left as it is (encoded, or refused, where it is written). Returns `value`.
 */
export function encodeOnce<T>(value: T): T {
  if (typeof value === 'object' && value !== null && !ENCODED_ONCE.has(value)) {
    const bytes = utf8JsonOrUndefined(value);
    if (bytes !== undefined) ENCODED_ONCE.set(value, bytes);
  }
  return value;
}

/**
 * Marks `list` append-only: `encodeJsonBytes` encodes each item once, the first time it writes it,
 * and reuses those bytes after. Items may be added (by `appendEncoded` or `push`), never changed,
 * removed or reordered. Returns `list` (anything not an array is left as it is).
 */
export function appendOnly<T>(list: T[]): T[] {
  if (Array.isArray(list) && !APPENDED.has(list)) APPENDED.set(list, []);
  return list;
}

/** Appends `items` to the append-only `list` (marking it so), each encoded once, now. */
export function appendEncoded<T>(list: T[], ...items: T[]): void {
  const encoded = APPENDED.get(appendOnly(list))!;
  // Items pushed without encoding before are encoded when first written, as `appendOnly` says.
  encoded.length = list.length;
  for (const item of items) {
    list.push(item);
    encoded.push(utf8JsonOrUndefined(item, ','));
  }
}

/**
 * `encodeJson(value)` as pieces (text and UTF-8 bytes) that join to the same bytes, writing the
 * kept bytes of values encoded once and of append-only arrays' items instead of encoding them
 * again. Throws the codec's `JsonEncodeError` for a value it refuses.
 */
export function encodeJsonBytes(value: unknown): (string | Uint8Array)[] {
  const out = new PieceList();
  writeBytes(value, 0, out);
  return out.finish();
}

/** Pieces with adjacent texts joined, so a store writing them switches between the two kinds rarely. */
class PieceList {
  readonly #pieces: (string | Uint8Array)[] = [];
  #text = '';

  text(text: string): void {
    this.#text += text;
  }

  bytes(bytes: Uint8Array): void {
    if (this.#text.length > 0) this.#pieces.push(this.#text);
    this.#text = '';
    this.#pieces.push(bytes);
  }

  finish(): (string | Uint8Array)[] {
    if (this.#text.length > 0) this.#pieces.push(this.#text);
    this.#text = '';
    return this.#pieces;
  }
}

function writeBytes(value: unknown, depth: number, out: PieceList): void {
  if (typeof value !== 'object' || value === null) {
    out.text(encodeJson(value));
    return;
  }
  const once = ENCODED_ONCE.get(value);
  if (once !== undefined) {
    out.bytes(once);
    return;
  }
  const items = Array.isArray(value) ? APPENDED.get(value) : undefined;
  if (items !== undefined) {
    writeAppended(value as unknown[], items, out);
  } else if (depth >= ENCODE_SPLIT_DEPTH || !(Array.isArray(value) || isPlainObject(value))) {
    // Deep (or not JSON, which the codec refuses): nothing kept below is looked for.
    out.text(encodeJson(value));
  } else if (Array.isArray(value)) {
    out.text('[');
    for (let i = 0; i < value.length; i++) {
      if (i > 0) out.text(',');
      writeBytes(value[i], depth + 1, out);
    }
    out.text(']');
  } else {
    const keys = jsonKeys(value);
    out.text('{');
    for (let i = 0; i < keys.length; i++) {
      const key = keys[i] as string;
      out.text(`${i > 0 ? ',' : ''}${JSON.stringify(key)}:`);
      writeBytes((value as Record<string, unknown>)[key], depth + 1, out);
    }
    out.text('}');
  }
}

/** An append-only array, each item's kept bytes (items new since are encoded now, and kept). */
function writeAppended(
  list: readonly unknown[],
  items: (Buffer | undefined)[],
  out: PieceList,
): void {
  // Shorter than its kept items: it was not append-only after all, so nothing kept is trusted.
  if (items.length > list.length) items.length = 0;
  // Brackets as text: they join the texts around them, one piece fewer per list for the store.
  out.text('[');
  for (let i = 0; i < list.length; i++) {
    // Refused items are encoded again here, so the codec's error is thrown.
    const item = (items[i] ??= utf8Json(list[i], ','));
    out.bytes(i === 0 ? item.subarray(1) : item);
  }
  out.text(']');
}
