import vm from 'node:vm';

import fc from 'fast-check';

import {
  decodeJson,
  encodeJson,
  encodeJsonWithin,
  JSON_KEY_ORDER,
  JsonDecodeError,
  JsonEncodeError,
  jsonKeys,
  type JsonObject,
  type JsonValue,
} from '../src/json.js';

/** The path of the first difference between two decoded values (key order and -0 included), or null. */
function jsonDifference(a: unknown, b: unknown, path = '$'): string | null {
  if (typeof a !== 'object' || a === null || typeof b !== 'object' || b === null) {
    return Object.is(a, b) ? null : path;
  }
  if (Array.isArray(a) !== Array.isArray(b)) return path;
  if (Array.isArray(a) && Array.isArray(b)) {
    if (a.length !== b.length) return `${path}.length`;
    for (const [i, item] of a.entries()) {
      const difference = jsonDifference(item, b[i], `${path}[${i}]`);
      if (difference !== null) return difference;
    }
    return null;
  }
  const keysA = jsonKeys(a);
  if (keysA.join('\u0000') !== jsonKeys(b).join('\u0000')) return `${path} keys`;
  for (const key of keysA) {
    const difference = jsonDifference(
      (a as Record<string, unknown>)[key],
      (b as Record<string, unknown>)[key],
      `${path}[${JSON.stringify(key)}]`,
    );
    if (difference !== null) return difference;
  }
  return null;
}

function asObject(value: JsonValue): JsonObject {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw new Error(`not an object: ${String(value)}`);
  }
  return value;
}

describe('special numbers', () => {
  test('NaN, Infinity and -Infinity are written as bare tokens and read back', () => {
    const text = encodeJson({ a: NaN, b: [Infinity, -Infinity] });
    expect(text).toBe('{"a":NaN,"b":[Infinity,-Infinity]}');
    expect(jsonDifference(decodeJson(text), { a: NaN, b: [Infinity, -Infinity] })).toBeNull();
    expect(encodeJson(NaN)).toBe('NaN');
    expect(decodeJson(' -Infinity ')).toBe(-Infinity);
  });

  test('-0 is written as -0.0 and reads back as -0', () => {
    expect(encodeJson(-0)).toBe('-0.0');
    expect(encodeJson([0, -0])).toBe('[0,-0.0]');
    expect(Object.is(decodeJson('-0.0'), -0)).toBe(true);
    expect(Object.is(decodeJson('-0'), -0)).toBe(true);
    expect(Object.is((decodeJson('[-0.0, NaN]') as JsonValue[])[0], -0)).toBe(true);
  });

  test('integers outside the safe range read back as bigint, inside it as numbers', () => {
    expect(decodeJson('9007199254740991')).toBe(9007199254740991);
    expect(decodeJson('9007199254740992')).toBe(9007199254740992n);
    expect(decodeJson('-9007199254740992')).toBe(-9007199254740992n);
    expect(decodeJson('{"seed": 18446744073709551616}')).toEqual({ seed: 18446744073709551616n });
  });

  test('bigints are written as digits; one inside the safe range reads back as a number', () => {
    expect(encodeJson({ big: 2n ** 64n, neg: -(2n ** 70n) })).toBe(
      '{"big":18446744073709551616,"neg":-1180591620717411303424}',
    );
    expect(encodeJson(7n)).toBe('7');
    expect(decodeJson(encodeJson(7n))).toBe(7);
  });

  test('an integral double beyond the safe range is written so it reads back as a number', () => {
    expect(encodeJson([2 ** 53, -1e20, 1e21])).toBe(
      '[9007199254740992.0,-100000000000000000000.0,1e+21]',
    );
    expect(decodeJson('[9007199254740992.0,-100000000000000000000.0,1e+21]')).toEqual([
      2 ** 53,
      -1e20,
      1e21,
    ]);
  });

  test.each([
    ['at the start', '9007199254740993', 9007199254740993n],
    ['negative', '-9007199254740993', -9007199254740993n],
    ['after [', '[9007199254740993]', [9007199254740993n]],
    ['after ,', '[1,9007199254740993]', [1, 9007199254740993n]],
    ['after :', '{"a":9007199254740993}', { a: 9007199254740993n }],
    ['after a space', '[ 9007199254740993 ]', [9007199254740993n]],
    ['after a newline', '[\n9007199254740993]', [9007199254740993n]],
    ['after a tab', '[\t9007199254740993]', [9007199254740993n]],
    ['after a carriage return', '[\r9007199254740993]', [9007199254740993n]],
    ['with many digits', '[-123456789012345678901234567890]', [-123456789012345678901234567890n]],
  ])('a big integer literal is read as a bigint wherever it stands: %s', (_where, text, value) => {
    expect(decodeJson(text)).toEqual(value);
  });

  test('digits inside strings, fractions and exponents leave numbers and strings as they are', () => {
    const text =
      '{"id":"session-18662876171143309490dc","t":0.12345678901234567,"e":1e-12345678901234567,"n":-0}';
    const decoded = asObject(decodeJson(text));
    expect(decoded.id).toBe('session-18662876171143309490dc');
    expect(decoded.t).toBe(Number('0.12345678901234567'));
    expect(decoded.e).toBe(0);
    expect(Object.is(decoded.n, -0)).toBe(true);
  });

  test('float literals with many digits stay numbers', () => {
    const literals = ['0.12345678901234567', '12345678901234567890.5', '1.5e300'];
    expect(decodeJson(`[${literals.join(', ')}]`)).toEqual(literals.map(Number));
  });
});

describe('key order', () => {
  test('integer-like keys keep their text order through decode and encode', () => {
    const decoded = asObject(decodeJson('{"b":1,"2":2,"1":3}'));
    expect(Object.keys(decoded)).toEqual(['1', '2', 'b']);
    expect(jsonKeys(decoded)).toEqual(['b', '2', '1']);
    expect(encodeJson(decoded)).toBe('{"b":1,"2":2,"1":3}');
  });

  test('key order is kept in nested objects and on the slow path', () => {
    const text = '[{"x":{"10":1,"9":2}},NaN,{"z":{"b":0,"0":1}}]';
    expect(encodeJson(decodeJson(text))).toBe(text);
  });

  test('a decoded object looks plain: the recorded order is non-enumerable', () => {
    const decoded = asObject(decodeJson('{"b":1,"1":2}'));
    expect(Object.getPrototypeOf(decoded)).toBe(Object.prototype);
    expect(decoded).toEqual({ 1: 2, b: 1 });
    expect({ ...decoded }).toEqual({ 1: 2, b: 1 });
    expect(Object.getOwnPropertyDescriptor(decoded, JSON_KEY_ORDER)?.enumerable).toBe(false);
  });

  test('after edits the encoder writes recorded keys still present, then new keys', () => {
    const decoded = asObject(decodeJson('{"b":1,"2":2,"1":3}'));
    delete decoded['2'];
    decoded.a = 4;
    decoded['0'] = 5;
    expect(encodeJson(decoded)).toBe('{"b":1,"1":3,"0":5,"a":4}');
  });

  test('integer-like keys already in JS order need no record', () => {
    const decoded = asObject(decodeJson('{"1":1,"2":2,"b":3,"01":4}'));
    expect(Object.getOwnPropertySymbols(decoded)).toEqual([]);
    expect(encodeJson(decoded)).toBe('{"1":1,"2":2,"b":3,"01":4}');
  });

  test('an escaped digit key is ordered like a plain one', () => {
    expect(encodeJson(decodeJson('{"b":1,"\\u0031":2}'))).toBe('{"b":1,"1":2}');
    expect(encodeJson(decodeJson('{"b":1,"1\\u0032":2}'))).toBe('{"b":1,"12":2}');
  });

  test('a digit key followed by whitespace before its colon keeps its place', () => {
    expect(encodeJson(decodeJson('{"b":1, "2"\n :2,"1"\t: 3}'))).toBe('{"b":1,"2":2,"1":3}');
  });

  test('a duplicate key keeps the last value at its first position, as JSON.parse does', () => {
    expect(encodeJson(decodeJson('{"a":1,"b":2,"a":3}'))).toBe('{"a":3,"b":2}');
    expect(encodeJson(decodeJson('{"b":1,"1":2,"b":3}'))).toBe('{"b":3,"1":2}');
  });

  test.each([
    ['fast path', '{"__proto__":{"polluted":1},"x":1}'],
    ['slow path', '{"__proto__":{"polluted":1},"x":NaN}'],
  ])('__proto__ keys are own data properties (%s)', (_path, text) => {
    const decoded = asObject(decodeJson(text));
    expect(Object.getPrototypeOf(decoded)).toBe(Object.prototype);
    expect(Object.hasOwn(decoded, '__proto__')).toBe(true);
    expect(({} as Record<string, unknown>).polluted).toBeUndefined();
    expect(encodeJson(decoded)).toBe(text);
  });

  test('an own __proto__ property is written like any key', () => {
    const value = {};
    Object.defineProperty(value, '__proto__', { value: [NaN], enumerable: true });
    expect(encodeJson(value)).toBe('{"__proto__":[NaN]}');
  });
});

describe('deep nesting', () => {
  /** Alternates objects and arrays: {"k":[{"k":[…leaf…]}]}. */
  function nested(depth: number, leaf: JsonValue): JsonValue {
    let value = leaf;
    for (let i = 0; i < depth; i++) value = i % 2 === 0 ? [value] : { k: value };
    return value;
  }

  function nestedText(depth: number, leaf: string): string {
    let open = '';
    let close = '';
    for (let i = depth - 1; i >= 0; i--) {
      open += i % 2 === 0 ? '[' : '{"k":';
      close = (i % 2 === 0 ? ']' : '}') + close;
    }
    return open + leaf + close;
  }

  function isNested(value: JsonValue, depth: number, leaf: JsonValue): boolean {
    let current = value;
    for (let i = depth - 1; i >= 0; i--) {
      if (i % 2 === 0) {
        if (!Array.isArray(current) || current.length !== 1) return false;
        current = current[0]!;
      } else {
        if (typeof current !== 'object' || current === null || Array.isArray(current)) return false;
        if (Object.keys(current).join() !== 'k') return false;
        current = current.k!;
      }
    }
    return Object.is(current, leaf);
  }

  test.each([10_000, 20_000])('%i levels of arrays and objects encode and decode', (depth) => {
    const text = encodeJson(nested(depth, 1));
    expect(text).toBe(nestedText(depth, '1'));
    expect(isNested(decodeJson(text), depth, 1)).toBe(true);
  });

  test.each([10_000, 20_000])(
    '%i levels with a special leaf use the slow paths both ways',
    (depth) => {
      const text = encodeJson(nested(depth, NaN));
      expect(text).toBe(nestedText(depth, 'NaN'));
      expect(isNested(decodeJson(text), depth, NaN)).toBe(true);
    },
  );

  test('a shared object that is not a cycle is written at each place', () => {
    const shared = { x: 1 };
    expect(encodeJson({ a: shared, b: [shared] })).toBe('{"a":{"x":1},"b":[{"x":1}]}');
  });
});

describe('strings', () => {
  test.each(['\ud800', 'x\udc00', 'a\ud83d', '\ude00\ud83d'])(
    'lone surrogates in %j are escaped and read back exactly',
    (s) => {
      const text = encodeJson({ [s]: [s, NaN] });
      expect(text).not.toMatch(/[\ud800-\udfff]/);
      const decoded = asObject(decodeJson(text));
      expect(Object.keys(decoded)).toEqual([s]);
      expect(decoded[s]).toEqual([s, NaN]);
      expect(decodeJson(encodeJson(s))).toBe(s);
    },
  );

  test('a surrogate pair is written as the character itself', () => {
    expect(encodeJson('😀')).toBe('"😀"');
    expect(decodeJson('"\\ud83d\\ude00"')).toBe('😀');
  });

  test('escapes and control characters round-trip on the slow path', () => {
    const s = 'q"\\/\b\f\n\r\t\u0001é';
    const text = encodeJson([s, NaN]);
    expect(decodeJson(text)).toEqual([s, NaN]);
  });
});

describe("reading Python's json.dumps output", () => {
  test('NaN, spacing and \\u escapes', () => {
    const decoded = decodeJson(String.raw`{"a": NaN, "b": [1, 2], "c": "\u00e9"}`);
    expect(jsonDifference(decoded, { a: NaN, b: [1, 2], c: 'é' })).toBeNull();
    expect(encodeJson(decoded)).toBe('{"a":NaN,"b":[1,2],"c":"é"}');
  });

  test('infinities, -0.0, big integers and integral floats', () => {
    const decoded = decodeJson(
      String.raw`{"episode_id": {"rollout_id": "r", "attempt": 0}, "rows": [Infinity, -Infinity, -0.0, 1.5, 18446744073709551616, -9223372036854775808, 1e+20, 9007199254740992.0]}`,
    );
    const expected = {
      episode_id: { rollout_id: 'r', attempt: 0 },
      rows: [
        Infinity,
        -Infinity,
        -0,
        1.5,
        18446744073709551616n,
        -9223372036854775808n,
        1e20,
        2 ** 53,
      ],
    };
    expect(jsonDifference(decoded, expected)).toBeNull();
  });

  test('surrogate pairs, lone surrogates, escapes, integer keys and __proto__', () => {
    const decoded = decodeJson(
      String.raw`["\ud83d\ude00", "\ud800", "tab\tquote\"", {"2": "b", "1": "a"}, {"__proto__": null}]`,
    ) as JsonValue[];
    expect(decoded.slice(0, 3)).toEqual(['😀', '\ud800', 'tab\tquote"']);
    expect(jsonKeys(asObject(decoded[3]!))).toEqual(['2', '1']);
    expect(Object.hasOwn(asObject(decoded[4]!), '__proto__')).toBe(true);
    expect(encodeJson(decoded)).toBe(
      '["😀","\\ud800","tab\\tquote\\"",{"2":"b","1":"a"},{"__proto__":null}]',
    );
  });
});

describe('values the codec cannot write', () => {
  class Point {
    x = 1;
  }
  const holey: unknown[] = [1];
  holey[2] = 3;

  test.each<[string, unknown, string, string]>([
    ['undefined', { u: undefined }, '$.u', 'undefined'],
    ['undefined in an array', [undefined], '$[0]', 'undefined'],
    ['a function', { f: () => 1 }, '$.f', 'a function'],
    ['a symbol', [Symbol('s')], '$[0]', 'a symbol'],
    ['a Date', { rows: [{}, {}, {}, { when: new Date(0) }] }, '$.rows[3].when', 'a Date'],
    ['a Map', { m: new Map() }, '$.m', 'a Map'],
    ['a Set', { s: new Set([1]) }, '$.s', 'a Set'],
    ['a class instance', { p: new Point() }, '$.p', 'a Point'],
    ['a typed array', { t: new Uint8Array(2) }, '$.t', 'a Uint8Array'],
    ['an ArrayBuffer', [new ArrayBuffer(1)], '$[0]', 'an ArrayBuffer'],
    ['a sparse-array hole', { a: holey }, '$.a[1]', 'an array hole'],
    ['a boxed number', { n: Object(1) }, '$.n', 'a boxed Number'],
    ['a boxed string', { n: Object('s') }, '$.n', 'a boxed String'],
    ['a boxed boolean', { n: Object(true) }, '$.n', 'a boxed Boolean'],
    ['an odd key', { 'a b': [{ 'x.y': undefined }] }, '$["a b"][0]["x.y"]', 'undefined'],
    ['undefined at the root', undefined, '$', 'undefined'],
  ])('%s fails naming its path', (_kind, value, path, what) => {
    let error: unknown;
    try {
      encodeJson(value);
    } catch (err) {
      error = err;
    }
    expect(error).toBeInstanceOf(JsonEncodeError);
    expect((error as JsonEncodeError).path).toBe(path);
    expect((error as JsonEncodeError).message).toBe(`cannot encode ${what} at ${path}`);
  });

  test.each<[string, () => unknown, string, string]>([
    [
      'an object',
      () => {
        const root: Record<string, unknown> = { a: { b: {} } };
        (root.a as { b: Record<string, unknown> }).b.c = root.a;
        return root;
      },
      '$.a.b.c',
      '$.a',
    ],
    [
      'an array',
      () => {
        const root: unknown[] = [0];
        root.push(root);
        return root;
      },
      '$[1]',
      '$',
    ],
  ])('a cycle through %s fails naming its first turn', (_kind, make, path, target) => {
    expect(() => encodeJson(make())).toThrow(
      expect.objectContaining({
        name: 'JsonEncodeError',
        path,
        message: `cannot encode a circular reference back to ${target} at ${path}`,
      }),
    );
  });

  test('objects with a null prototype are plain', () => {
    const value = Object.assign(Object.create(null) as object, { a: 1 });
    expect(encodeJson(value)).toBe('{"a":1}');
  });

  test('plain objects and arrays from another realm are plain', () => {
    expect(encodeJson(vm.runInNewContext('({ a: [1, { b: NaN }] })'))).toBe('{"a":[1,{"b":NaN}]}');
  });
});

describe('decode errors', () => {
  test.each([
    ['', 0],
    ['   ', 3],
    ['[1,]', 3],
    ['{"a" 1}', 5],
    ['{"a":1,}', 7],
    ['{"a":1', 6],
    ['[1 2]', 3],
    ['[', 1],
    ['"abc', 0],
    ['[1] x', 4],
    ['nul', 0],
    ['NaNa', 3],
    ['01', 1],
    ['-', 0],
    ['"a\u0001"', 2],
    ['"a\\q"', 2],
    ['"\\u12x4"', 1],
    ['[NaN x]', 5],
    ['{1:2}', 1],
  ])('%j fails at position %i', (text, position) => {
    let error: unknown;
    try {
      decodeJson(text);
    } catch (err) {
      error = err;
    }
    expect(error).toBeInstanceOf(JsonDecodeError);
    expect((error as JsonDecodeError).position).toBe(position);
    expect((error as JsonDecodeError).message).toMatch(new RegExp(`at position ${position}$`));
  });
});

// ---------------------------------------------------------------------------------------------
// Properties. A tree lists object entries in any order, so it can describe texts JS objects
// cannot hold in order.

type Tree = { leaf: JsonValue } | { array: Tree[] } | { entries: [string, Tree][] };

const anyChar = fc.oneof(
  fc.string({ minLength: 1, maxLength: 1 }),
  fc.integer({ min: 0, max: 0xffff }).map((code) => String.fromCharCode(code)),
  fc.constantFrom('\ud800', '\udbff', '\udc00', '\udfff', '😀', '"', '\\', '\n', 'é'),
);
const anyString = fc.string({ unit: anyChar, maxLength: 8 });
const anyKey = fc.oneof(
  anyString,
  fc.nat().map(String),
  fc.constantFrom(
    '__proto__',
    '0',
    '1',
    '10',
    '01',
    '4294967295',
    '9007199254740993',
    'constructor',
  ),
);
const specialNumber = fc.constantFrom(
  NaN,
  Infinity,
  -Infinity,
  -0,
  2 ** 53,
  -(2 ** 60),
  1e20,
  Number.MAX_VALUE,
);
const bigOutsideSafe = fc.oneof(
  fc.bigInt({ min: 2n ** 53n, max: 2n ** 128n }),
  fc.bigInt({ min: -(2n ** 128n), max: -(2n ** 53n) }),
);
const leaf: fc.Arbitrary<JsonValue> = fc.oneof(
  fc.constant(null),
  fc.boolean(),
  fc.double(),
  fc.integer(),
  specialNumber,
  bigOutsideSafe,
  anyString,
);

const { tree } = fc.letrec<{ tree: Tree }>((tie) => ({
  tree: fc.oneof(
    { depthSize: 'small', withCrossShrink: true },
    leaf.map((value): Tree => ({ leaf: value })),
    fc.array(tie('tree'), { maxLength: 4 }).map((array): Tree => ({ array })),
    fc
      .uniqueArray(fc.tuple(anyKey, tie('tree')), { selector: ([key]) => key, maxLength: 4 })
      .map((entries): Tree => ({ entries })),
  ),
}));

/** The compact text of a tree, scalars as the codec writes them. */
function render(node: Tree): string {
  if ('leaf' in node) return encodeJson(node.leaf);
  if ('array' in node) return `[${node.array.map(render).join(',')}]`;
  return `{${node.entries.map(([key, value]) => `${encodeJson(key)}:${render(value)}`).join(',')}}`;
}

/** The JS value of a tree; its objects list keys in JS order. */
function toValue(node: Tree): JsonValue {
  if ('leaf' in node) return node.leaf;
  if ('array' in node) return node.array.map(toValue);
  const object: JsonObject = {};
  for (const [key, value] of node.entries) {
    Object.defineProperty(object, key, {
      value: toValue(value),
      enumerable: true,
      writable: true,
      configurable: true,
    });
  }
  return object;
}

/** True when `value` is what decoding the tree's text must give, keys in the tree's order. */
function matches(node: Tree, value: JsonValue): boolean {
  if ('leaf' in node) return Object.is(node.leaf, value);
  if ('array' in node) {
    return (
      Array.isArray(value) &&
      value.length === node.array.length &&
      node.array.every((item, i) => matches(item, value[i]!))
    );
  }
  if (typeof value !== 'object' || value === null || Array.isArray(value)) return false;
  if (Object.getPrototypeOf(value) !== Object.prototype) return false;
  const keys = jsonKeys(value);
  return (
    keys.length === node.entries.length &&
    node.entries.every(([key, item], i) => keys[i] === key && matches(item, value[key]!))
  );
}

describe('encoding within a length', () => {
  test('property: the text is encodeJson, and is given whenever it fits the length', () => {
    fc.assert(
      fc.property(tree, fc.nat(120), (node, maxChars) => {
        const value = toValue(node);
        const text = encodeJson(value);
        const within = encodeJsonWithin(value, maxChars);
        if (text.length <= maxChars) expect(within).toBe(text);
        else if (within !== undefined) expect(within).toBe(text);
      }),
    );
  });

  test.each([
    ['a long string', { a: 'x'.repeat(100) }],
    ['long keys', { ['k'.repeat(60)]: 1, ['j'.repeat(60)]: 2 }],
    ['many numbers', Array.from({ length: 120 }, () => 0)],
    ['special numbers', [NaN, ...Array.from({ length: 120 }, () => -0)]],
  ])('a value whose text is clearly longer gives no text: %s', (_what, value) => {
    expect(encodeJsonWithin(value, 100)).toBeUndefined();
    expect(encodeJsonWithin(value, 10_000)).toBe(encodeJson(value));
  });

  test('a value the codec cannot write is refused as encodeJson refuses it', () => {
    expect(() => encodeJsonWithin({ a: [1, new Date(0)] }, 1000)).toThrow(
      new JsonEncodeError('a Date', '$.a[1]'),
    );
  });
});

describe('properties', () => {
  test('arbitrary values round-trip through encode, decode, encode with identical text', () => {
    fc.assert(
      fc.property(tree, (node) => {
        const value = toValue(node);
        const text = encodeJson(value);
        const decoded = decodeJson(text);
        expect(jsonDifference(decoded, value)).toBeNull();
        expect(encodeJson(decoded)).toBe(text);
      }),
    );
  });

  test('texts with keys in any order decode to their order and encode back to the same text', () => {
    fc.assert(
      fc.property(tree, (node) => {
        const text = render(node);
        const decoded = decodeJson(text);
        expect(matches(node, decoded)).toBe(true);
        expect(encodeJson(decoded)).toBe(text);
      }),
    );
  });

  test('the slow parser and encoder agree with the fast paths', () => {
    fc.assert(
      fc.property(tree, (node) => {
        const text = render(node);
        const [slow, nan] = decodeJson(`[${text},NaN]`) as [JsonValue, JsonValue];
        expect(Number.isNaN(nan)).toBe(true);
        expect(matches(node, slow)).toBe(true);
        expect(encodeJson([decodeJson(text), NaN])).toBe(`[${text},NaN]`);
      }),
    );
  });
});
