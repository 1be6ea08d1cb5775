/**
 * The faithful JSON codec. Opaque payloads (boundaries, session states, tool outputs) must
 * round-trip exactly, which `JSON.stringify`/`JSON.parse` alone do not do:
 *
 * - `NaN`, `Infinity`, `-Infinity` are written as those bare tokens (as Python's `json` does) and
 *   read back; `-0` is written `-0.0`, which Python reads as a float and `JSON.parse` as `-0`.
 * - A `bigint` is written as its digits. An integer literal outside the safe-integer range reads
 *   back as a `bigint`, one inside it as a number: so a bigint inside the safe range comes back as
 *   a number, and an integral double outside it is written with `.0` (or an exponent) so that it
 *   comes back as a number.
 * - Key order is kept. JS objects list integer-like keys first, so an object whose keys the text
 *   orders differently is returned as a plain object that records the text's order under the
 *   non-enumerable `JSON_KEY_ORDER`; the encoder writes the recorded keys still present in that
 *   order, then keys added since. Spreading or cloning such an object drops the record.
 * - `__proto__` keys are own data properties, as with `JSON.parse`.
 * - Strings with lone surrogates are escaped (`\ud800`) and read back exactly.
 * - Nesting depth is bounded only by memory: the slow encoder and parser use explicit stacks.
 *
 * Speed: the encoder makes one cheap walk that validates the value and looks for anything special;
 * without one it returns `JSON.stringify(value)`. The decoder tries `JSON.parse` (iterative in V8,
 * fine at any depth) and walks the result: only a parse error (such as a `NaN` token), a key
 * starting with a digit or a number beyond the safe range sends the text to the iterative parser.
 * Walking the parsed value costs far less than scanning the text.
 */

export type JsonValue =
  null | boolean | number | bigint | string | JsonValue[] | { [key: string]: JsonValue };
export type JsonObject = { [key: string]: JsonValue };

/** Where a decoded object keeps its keys' text order when JS would list them differently. */
export const JSON_KEY_ORDER: unique symbol = Symbol.for('@ckpt-gym/core/json.keyOrder');

/** A value the codec cannot write; `path` locates it inside the encoded value, e.g. `$.rows[3].when`. */
export class JsonEncodeError extends Error {
  readonly path: string;

  constructor(what: string, path: string) {
    super(`cannot encode ${what} at ${path}`);
    this.name = 'JsonEncodeError';
    this.path = path;
  }
}

/** Text that is not JSON; `position` is the index of the offending character in the text. */
export class JsonDecodeError extends Error {
  readonly position: number;

  constructor(problem: string, position: number) {
    super(`${problem} at position ${position}`);
    this.name = 'JsonDecodeError';
    this.position = position;
  }
}

type KeyOrdered = { [JSON_KEY_ORDER]?: readonly string[] };

/**
 * The keys of a plain object in the order the codec writes them: a decoded object's recorded order
 * (keys still present), then keys added since; otherwise `Object.keys` order.
 */
export function jsonKeys(obj: object): string[] {
  const keys = Object.keys(obj);
  const recorded = (obj as KeyOrdered)[JSON_KEY_ORDER];
  return recorded === undefined ? keys : mergeKeyOrder(recorded, keys);
}

function mergeKeyOrder(recorded: readonly string[], keys: string[]): string[] {
  const unplaced = new Set(keys);
  const ordered: string[] = [];
  for (const key of recorded) if (unplaced.delete(key)) ordered.push(key);
  for (const key of keys) if (unplaced.has(key)) ordered.push(key);
  return ordered;
}

// ---------------------------------------------------------------------------------------------
// Encoding

/**
 * Nesting depth up to which `JSON.stringify` (recursive in V8, ~4,000 levels on a default stack)
 * may write a subtree; deeper values go through the iterative encoder.
 */
const NATIVE_DEPTH = 1000;

/** Encodes `value` as compact JSON, faithfully. Throws `JsonEncodeError` naming the bad value's path. */
export function encodeJson(value: unknown): string {
  return encodeScanned(value, scan(value, Infinity) as Set<object> | null); // never TOO_LONG
}

/**
 * `encodeJson(value)`, or undefined without building any text when the text would be longer than
 * `maxChars` (by a lower bound: a character per value plus the strings' and keys' lengths, so the
 * text may come out up to ~6 times longer where strings need escapes). Throws as `encodeJson`
 * for a bad value met before the bound is passed.
 */
export function encodeJsonWithin(value: unknown, maxChars: number): string | undefined {
  const special = scan(value, maxChars);
  return special === TOO_LONG ? undefined : encodeScanned(value, special);
}

function encodeScanned(value: unknown, special: Set<object> | null): string {
  return special === null ? (JSON.stringify(value) as string) : encodeSlow(value, special);
}

const TOO_LONG = Symbol('too long');

interface ScanFrame {
  node: object;
  /** null for an array. */
  keys: string[] | null;
  /** Index of the next child; the child being looked at is `next - 1`. */
  next: number;
  /** The node is in the special set (and so are all frames below it). */
  special: boolean;
}

/** True for a number `JSON.stringify` cannot write so that `JSON.parse` reads it back. */
function isSpecialNumber(n: number): boolean {
  return !(n >= -Number.MAX_SAFE_INTEGER && n <= Number.MAX_SAFE_INTEGER) || (n === 0 && 1 / n < 0);
}

/**
 * Checks that `root` is plain JSON, throwing `JsonEncodeError` otherwise. Returns null when
 * `JSON.stringify(root)` is exact; else the set of containers that `JSON.stringify` cannot write:
 * those holding a special number or bigint, a recorded key order, or nesting beyond NATIVE_DEPTH.
 * Stops with TOO_LONG once the text's lower bound (see encodeJsonWithin) passes `budget`.
 */
function scan(root: unknown, budget: number): Set<object> | null | typeof TOO_LONG {
  const stack: ScanFrame[] = [];
  let special: Set<object> | null = null;
  let chars = 0;
  // Cycles are only looked for once the walk gets deep, since a cycle always gets it there.
  let ancestors: Set<object> | null = null;

  const markStack = (): void => {
    special ??= new Set();
    for (let i = stack.length - 1; i >= 0; i--) {
      const frame = stack[i]!;
      if (frame.special) break;
      frame.special = true;
      special.add(frame.node);
    }
  };

  let value = root;
  for (;;) {
    if (++chars > budget) return TOO_LONG;
    switch (typeof value) {
      case 'string':
        if ((chars += value.length) > budget) return TOO_LONG;
        break;
      case 'boolean':
        break;
      case 'number':
        if (isSpecialNumber(value)) markStack();
        break;
      case 'bigint':
        markStack();
        break;
      case 'object': {
        if (value === null) break;
        let keys: string[] | null = null;
        let ordered = false;
        if (!Array.isArray(value)) {
          const proto: unknown = Object.getPrototypeOf(value);
          // Any realm's Object.prototype has a null prototype; class instances' prototypes do not.
          if (proto !== null && Object.getPrototypeOf(proto) !== null) {
            throw new JsonEncodeError(describe(value), pathOf(stack));
          }
          const recorded = (value as KeyOrdered)[JSON_KEY_ORDER];
          keys = Object.keys(value);
          if (recorded !== undefined) {
            keys = mergeKeyOrder(recorded, keys);
            ordered = true;
          }
        }
        if (ancestors === null && stack.length >= NATIVE_DEPTH) {
          ancestors = new Set(stack.map((frame) => frame.node));
        }
        if (ancestors !== null) {
          if (ancestors.has(value)) throw cycleError(stack, value);
          ancestors.add(value);
        }
        stack.push({ node: value, keys, next: 0, special: false });
        if (ordered || stack.length > NATIVE_DEPTH) markStack();
        break;
      }
      default:
        throw new JsonEncodeError(describeMissing(value, stack), pathOf(stack));
    }

    for (;;) {
      const top = stack[stack.length - 1];
      if (top === undefined) return special;
      if (top.keys === null) {
        const array = top.node as unknown[];
        if (top.next < array.length) {
          value = array[top.next++];
          break;
        }
      } else if (top.next < top.keys.length) {
        const key = top.keys[top.next++]!;
        chars += key.length;
        value = (top.node as Record<string, unknown>)[key];
        break;
      }
      stack.pop();
      ancestors?.delete(top.node);
    }
  }
}

const IDENTIFIER = /^[A-Za-z_$][\w$]*$/;

/** The path of the child each frame is looking at, e.g. `$.rows[3].when`. */
function pathOf(frames: readonly ScanFrame[]): string {
  let path = '$';
  for (const frame of frames) {
    const index = frame.next - 1;
    if (frame.keys === null) {
      path += `[${index}]`;
    } else {
      const key = frame.keys[index]!;
      path += IDENTIFIER.test(key) ? `.${key}` : `[${JSON.stringify(key)}]`;
    }
  }
  return path;
}

function cycleError(stack: readonly ScanFrame[], node: object): JsonEncodeError {
  // Report the cycle's first turn, not the deep point where the walk noticed it.
  const seen = new Map<object, number>();
  let closing = stack.length;
  for (const [i, frame] of stack.entries()) {
    if (seen.has(frame.node)) {
      closing = i;
      break;
    }
    seen.set(frame.node, i);
  }
  const target = closing === stack.length ? node : stack[closing]!.node;
  const first = seen.get(target)!;
  return new JsonEncodeError(
    `a circular reference back to ${pathOf(stack.slice(0, first))}`,
    pathOf(stack.slice(0, closing)),
  );
}

const BOXED = new Set(['Number', 'String', 'Boolean', 'BigInt', 'Symbol']);

function describe(value: object): string {
  const name = (value as { constructor?: { name?: unknown } }).constructor?.name;
  if (typeof name !== 'string' || name === '') return 'an object with a non-plain prototype';
  if (BOXED.has(name)) return `a boxed ${name}`;
  return /^[AEIO]/.test(name) ? `an ${name}` : `a ${name}`;
}

/** Names a value that is neither a JSON primitive nor an object: undefined, a function, a symbol. */
function describeMissing(value: unknown, stack: readonly ScanFrame[]): string {
  if (value !== undefined) return `a ${typeof value}`;
  const top = stack[stack.length - 1];
  const isHole = top !== undefined && top.keys === null && !(top.next - 1 in top.node);
  return isHole ? 'an array hole' : 'undefined';
}

interface EncodeFrame {
  node: object;
  keys: string[] | null;
  next: number;
}

/** The iterative encoder; writes containers outside `special` with `JSON.stringify`. */
function encodeSlow(root: unknown, special: Set<object>): string {
  const stack: EncodeFrame[] = [];
  let out = '';
  let value = root;
  for (;;) {
    if (typeof value === 'object' && value !== null && special.has(value)) {
      if (Array.isArray(value)) {
        out += '[';
        stack.push({ node: value, keys: null, next: 0 });
      } else {
        out += '{';
        stack.push({ node: value, keys: jsonKeys(value), next: 0 });
      }
    } else {
      out += leafText(value);
    }

    for (;;) {
      const top = stack[stack.length - 1];
      if (top === undefined) return out;
      if (top.keys === null) {
        const array = top.node as unknown[];
        if (top.next < array.length) {
          if (top.next > 0) out += ',';
          value = array[top.next++];
          break;
        }
        out += ']';
      } else {
        if (top.next < top.keys.length) {
          const key = top.keys[top.next]!;
          out += `${top.next > 0 ? ',' : ''}${JSON.stringify(key)}:`;
          top.next++;
          value = (top.node as Record<string, unknown>)[key];
          break;
        }
        out += '}';
      }
      stack.pop();
    }
  }
}

/** A scalar, or a container the scan found free of anything special. */
function leafText(value: unknown): string {
  if (typeof value === 'number') return numberText(value);
  if (typeof value === 'bigint') return value.toString();
  return JSON.stringify(value) as string;
}

function numberText(n: number): string {
  if (Number.isNaN(n)) return 'NaN';
  if (n === Infinity) return 'Infinity';
  if (n === -Infinity) return '-Infinity';
  if (n === 0 && 1 / n < 0) return '-0.0';
  const text = String(n);
  // Digits alone beyond the safe range would read back as a bigint.
  return Number.isSafeInteger(n) || !/^-?\d+$/.test(text) ? text : `${text}.0`;
}

// ---------------------------------------------------------------------------------------------
// Decoding

/** Decodes JSON text, faithfully. Throws `JsonDecodeError` with the offending position. */
export function decodeJson(text: string): JsonValue {
  let value: JsonValue;
  try {
    value = JSON.parse(text) as JsonValue;
  } catch (err) {
    // NaN and Infinity land here too; the slow parser reads them, or finds the error's position.
    if (!(err instanceof SyntaxError)) throw err;
    return new Parser(text).parse();
  }
  return parsedExactly(value) ? value : new Parser(text).parse();
}

/**
 * True unless `JSON.parse` may have read the text inexactly: an object has an integer key (JS
 * may have moved it), or a number is beyond the safe-integer range (it may have been a
 * big integer literal).
 */
function parsedExactly(root: JsonValue): boolean {
  const pending: JsonValue[] = [root];
  for (;;) {
    const value = pending.pop();
    if (value === undefined) return true;
    if (typeof value === 'number') {
      if (value > Number.MAX_SAFE_INTEGER || value < -Number.MAX_SAFE_INTEGER) return false;
    } else if (Array.isArray(value)) {
      for (const item of value) {
        if (typeof item === 'object' || typeof item === 'number') pending.push(item);
      }
    } else if (typeof value === 'object' && value !== null) {
      for (const key of Object.keys(value)) {
        if (isDigit(key.charCodeAt(0)) && INTEGER_KEY.test(key)) return false;
        const item = value[key]!;
        if (typeof item === 'object' || typeof item === 'number') pending.push(item);
      }
    }
  }
}

interface ParseFrame {
  array: JsonValue[] | null;
  object: JsonObject | null;
  key: string;
  /** Keys in text order, kept from the first key starting with a digit, which JS may reorder. */
  order: string[] | null;
}

// eslint-disable-next-line no-control-regex -- JSON strings may not hold raw control characters
const PLAIN_STRING = /"[^"\\\u0000-\u001f]*"/y;
const NUMBER = /-?(?:0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?/y;
const HEX4 = /^[0-9a-fA-F]{4}$/;
/** A superset of the keys JS lists first (array indices). */
const INTEGER_KEY = /^(?:0|[1-9]\d*)$/;

function isDigit(code: number): boolean {
  return code >= 0x30 && code <= 0x39;
}

/** The iterative parser: JSON plus NaN, Infinity, -Infinity, big integers and key order. */
class Parser {
  private pos = 0;

  constructor(private readonly text: string) {}

  parse(): JsonValue {
    const stack: ParseFrame[] = [];
    for (;;) {
      let value: JsonValue;
      this.skipWhitespace();
      const c = this.text.charCodeAt(this.pos);
      if (c === 0x7b /* { */ || c === 0x5b /* [ */) {
        this.pos++;
        this.skipWhitespace();
        const close = c === 0x7b ? 0x7d : 0x5d;
        if (this.text.charCodeAt(this.pos) === close) {
          this.pos++;
          value = c === 0x7b ? {} : [];
        } else if (c === 0x7b) {
          const frame: ParseFrame = { array: null, object: {}, key: '', order: null };
          stack.push(frame);
          this.readKey(frame);
          continue;
        } else {
          stack.push({ array: [], object: null, key: '', order: null });
          continue;
        }
      } else {
        value = this.readScalar();
      }

      for (;;) {
        const top = stack[stack.length - 1];
        if (top === undefined) {
          this.skipWhitespace();
          if (this.pos < this.text.length) throw this.error('unexpected text after the JSON value');
          return value;
        }
        if (top.array !== null) top.array.push(value);
        else setMember(top, value);
        this.skipWhitespace();
        const d = this.text.charCodeAt(this.pos);
        if (d === 0x2c /* , */) {
          this.pos++;
          if (top.array === null) this.readKey(top);
          break;
        }
        if (d === (top.array !== null ? 0x5d : 0x7d)) {
          this.pos++;
          stack.pop();
          value = top.array ?? finishObject(top);
          continue;
        }
        throw this.error(top.array !== null ? "expected ',' or ']'" : "expected ',' or '}'");
      }
    }
  }

  private readKey(frame: ParseFrame): void {
    this.skipWhitespace();
    if (this.text.charCodeAt(this.pos) !== 0x22) throw this.error('expected a string key');
    frame.key = this.readString();
    this.skipWhitespace();
    if (this.text.charCodeAt(this.pos) !== 0x3a) throw this.error("expected ':'");
    this.pos++;
  }

  private readScalar(): JsonValue {
    const { text, pos } = this;
    switch (text.charCodeAt(pos)) {
      case 0x22:
        return this.readString();
      case 0x74:
        return this.readWord('true', true);
      case 0x66:
        return this.readWord('false', false);
      case 0x6e:
        return this.readWord('null', null);
      case 0x4e:
        return this.readWord('NaN', NaN);
      case 0x49:
        return this.readWord('Infinity', Infinity);
      case 0x2d:
        if (text.charCodeAt(pos + 1) === 0x49) return this.readWord('-Infinity', -Infinity);
        return this.readNumber();
      default:
        if (isDigit(text.charCodeAt(pos))) return this.readNumber();
        throw this.error('expected a JSON value');
    }
  }

  private readWord<T extends JsonValue>(word: string, value: T): T {
    if (!this.text.startsWith(word, this.pos)) throw this.error('invalid literal');
    this.pos += word.length;
    return value;
  }

  private readNumber(): number | bigint {
    NUMBER.lastIndex = this.pos;
    const match = NUMBER.exec(this.text);
    if (match === null) throw this.error('invalid number');
    const literal = match[0];
    this.pos += literal.length;
    const n = Number(literal);
    const integral = match[1] === undefined && match[2] === undefined;
    return integral && !Number.isSafeInteger(n) ? BigInt(literal) : n;
  }

  private readString(): string {
    const { text } = this;
    const start = this.pos;
    PLAIN_STRING.lastIndex = start;
    if (PLAIN_STRING.test(text)) {
      this.pos = PLAIN_STRING.lastIndex;
      return text.slice(start + 1, this.pos - 1);
    }
    const end = closingQuote(text, start);
    if (end === -1) throw new JsonDecodeError('unterminated string', start);
    this.pos = end + 1;
    try {
      return JSON.parse(text.slice(start, end + 1)) as string;
    } catch {
      throw new JsonDecodeError('invalid string', badStringPosition(text, start, end));
    }
  }

  private skipWhitespace(): void {
    const { text } = this;
    let pos = this.pos;
    for (;;) {
      const c = text.charCodeAt(pos);
      if (c !== 0x20 && c !== 0x0a && c !== 0x0d && c !== 0x09) break;
      pos++;
    }
    this.pos = pos;
  }

  private error(problem: string): JsonDecodeError {
    const atEnd = this.pos >= this.text.length;
    return new JsonDecodeError(atEnd ? `unexpected end of input (${problem})` : problem, this.pos);
  }
}

function setMember(frame: ParseFrame, value: JsonValue): void {
  const object = frame.object!;
  const { key } = frame;
  if (frame.order === null && isDigit(key.charCodeAt(0))) frame.order = Object.keys(object);
  if (frame.order !== null && !Object.hasOwn(object, key)) frame.order.push(key);
  if (key === '__proto__') {
    Object.defineProperty(object, key, {
      value,
      writable: true,
      enumerable: true,
      configurable: true,
    });
  } else {
    object[key] = value;
  }
}

function finishObject(frame: ParseFrame): JsonObject {
  const object = frame.object!;
  const { order } = frame;
  if (order !== null && !sameKeys(order, Object.keys(object))) {
    Object.defineProperty(object, JSON_KEY_ORDER, {
      value: Object.freeze(order),
      configurable: true,
    });
  }
  return object;
}

function sameKeys(a: readonly string[], b: readonly string[]): boolean {
  return a.length === b.length && a.every((key, i) => key === b[i]);
}

/** The index of the quote closing the string opened at `start`, or -1. */
function closingQuote(text: string, start: number): number {
  let from = start + 1;
  for (;;) {
    const quote = text.indexOf('"', from);
    if (quote === -1) return -1;
    let backslashes = 0;
    while (text.charCodeAt(quote - 1 - backslashes) === 0x5c) backslashes++;
    if (backslashes % 2 === 0) return quote;
    from = quote + 1;
  }
}

/** The first character of the string at `start..end` that makes it invalid JSON. */
function badStringPosition(text: string, start: number, end: number): number {
  for (let i = start + 1; i < end; i++) {
    const c = text.charCodeAt(i);
    if (c < 0x20) return i;
    if (c !== 0x5c) continue;
    const escape = text[i + 1]!;
    if ('"\\/bfnrt'.includes(escape)) i++;
    else if (escape === 'u' && HEX4.test(text.slice(i + 2, i + 6))) i += 5;
    else return i;
  }
  return end;
}
