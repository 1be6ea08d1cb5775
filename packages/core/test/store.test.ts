import { jest } from '@jest/globals';
import { spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, readdir, readFile, rm, stat, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join, relative } from 'node:path';
import { fileURLToPath } from 'node:url';

import fc from 'fast-check';

import { CheckpointStateError } from '../src/errors.js';
import { parentsUpTo } from '../src/fsync.js';
import {
  appendEncoded,
  appendOnly,
  decodeJsonPieces,
  encodeJsonBytes,
  encodeJsonPieces,
  encodeOnce,
} from '../src/json-pieces.js';
import { captureKey, episodeId, type EpisodeId } from '../src/identity.js';
import {
  decodeJson,
  encodeJson,
  JsonEncodeError,
  jsonKeys,
  type JsonObject,
  type JsonValue,
} from '../src/json.js';
import {
  MANIFEST_FILE,
  participantDir,
  readParticipantState,
  readRawParticipantState,
  RECORD_FIELDS_JSON,
  WriteStop,
  writeParticipantState,
  type CheckpointRecord,
  type Manifest,
  type RawRecord,
  type ReadParticipantStateOptions,
} from '../src/store.js';

/** JSON-ish values, special numbers and big integers included. */
const jsonish = fc.letrec((tie) => ({
  value: fc.oneof(
    { depthSize: 'small', withCrossShrink: true },
    fc.constantFrom(NaN, Infinity, -Infinity, -0, 0, null, true, false),
    fc.double(),
    fc.bigInt({ min: -(2n ** 80n), max: 2n ** 80n }),
    fc.string({ unit: 'binary' }),
    fc.array(tie('value'), { maxLength: 5 }),
    fc.dictionary(fc.oneof(fc.string(), fc.constantFrom('1', '10', 'a', 'b')), tie('value'), {
      maxKeys: 5,
    }),
  ),
})).value;

const EMPTY_SHA256 = 'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855';
const here = dirname(fileURLToPath(import.meta.url));

let root: string;
beforeEach(async () => {
  root = await mkdtemp(join(tmpdir(), 'ckpt-gym-store-'));
});
afterEach(async () => {
  if (root) await rm(root, { recursive: true, force: true });
});

const KIND = 'agent';
const INSTANCE = 'simple_agent';

function record(
  rolloutId: string,
  attempt = 0,
  fields: Record<string, unknown> = {},
): CheckpointRecord {
  return { episode_id: episodeId(rolloutId, attempt), ...fields };
}

function write(
  records: Iterable<CheckpointRecord> | AsyncIterable<CheckpointRecord>,
  more: Partial<Parameters<typeof writeParticipantState>[0]> = {},
): Promise<Manifest> {
  return writeParticipantState({
    checkpointDir: root,
    kind: KIND,
    instance: INSTANCE,
    checkpointId: 'ckpt-1',
    records,
    ...more,
  });
}

function readAll<R = JsonObject>(
  more: Partial<ReadParticipantStateOptions<R>> = {},
): Promise<{ manifest: Manifest; records: R[] }> {
  return readParticipantState<R>({
    checkpointDir: root,
    kind: KIND,
    instance: INSTANCE,
    select: () => true,
    validate: (r) => r as R,
    ...more,
  });
}

const dir = () => participantDir(root, KIND, INSTANCE);
const files = async () => (existsSync(dir()) ? (await readdir(dir())).sort() : []);
const sha256 = (bytes: Buffer | string) => createHash('sha256').update(bytes).digest('hex');

/** Expects `promise` to reject with invalid_checkpoint_state whose detail matches `detail`. */
async function expectStateError(promise: Promise<unknown>, detail: RegExp | string): Promise<void> {
  const err = await promise.then(
    () => {
      throw new Error('expected invalid_checkpoint_state, but it succeeded');
    },
    (e: unknown) => e,
  );
  expect(err).toBeInstanceOf(CheckpointStateError);
  expect((err as CheckpointStateError).code).toBe('invalid_checkpoint_state');
  expect((err as CheckpointStateError).status).toBe(422);
  expect((err as CheckpointStateError).message).toMatch(detail);
}

/** Writes a records file and a manifest by hand, the manifest's digest and count matching. */
async function handWritten(
  content: string[] | string | Buffer,
  manifest: Record<string, unknown> = {},
  recordsFile?: string,
): Promise<void> {
  const bytes = Array.isArray(content)
    ? Buffer.from(content.map((line) => `${line}\n`).join(''))
    : Buffer.from(content);
  const newlines = bytes.toString('latin1').split('\n').length - 1;
  const unterminated = bytes.length > 0 && bytes[bytes.length - 1] !== 0x0a ? 1 : 0;
  const digest = sha256(bytes);
  const name = recordsFile ?? `records-${digest}.jsonl`;
  await mkdir(dir(), { recursive: true });
  await writeFile(join(dir(), name), bytes);
  await writeFile(
    join(dir(), MANIFEST_FILE),
    JSON.stringify({
      schema_version: 1,
      kind: KIND,
      instance: INSTANCE,
      checkpoint_id: 'ckpt-py',
      records_file: name,
      records_sha256: digest,
      record_count: newlines + unterminated,
      ...manifest,
    }),
  );
}

describe('layout and manifest', () => {
  test('writes records-<sha256>.jsonl and a manifest under gym/<kind>/<instance>', async () => {
    const manifest = await write([record('r', 0, { a: 1 }), record('s', 2, { b: [true, null] })]);

    const text = await readFile(join(root, 'gym', KIND, INSTANCE, manifest.records_file), 'utf8');
    expect(text).toBe(
      '{"episode_id":{"rollout_id":"r","attempt":0},"a":1}\n' +
        '{"episode_id":{"rollout_id":"s","attempt":2},"b":[true,null]}\n',
    );
    const digest = sha256(text);
    expect(manifest).toEqual({
      schema_version: 1,
      kind: KIND,
      instance: INSTANCE,
      checkpoint_id: 'ckpt-1',
      records_file: `records-${digest}.jsonl`,
      records_sha256: digest,
      record_count: 2,
      records_bytes: Buffer.byteLength(text),
    });
    expect(await files()).toEqual([MANIFEST_FILE, `records-${digest}.jsonl`]);
  });

  test('the manifest is written like json.dumps(sort_keys=True, indent=1): sorted, ASCII, no newline', async () => {
    const manifest = await write([record('r')], {
      manifestExtra: { zeta: 'café 🙂', alpha: [1, { b: 2 }, []], empty: {} },
    });
    const text = await readFile(join(dir(), MANIFEST_FILE), 'utf8');
    expect(text).toBe(
      [
        '{',
        ' "alpha": [',
        '  1,',
        '  {',
        '   "b": 2',
        '  },',
        '  []',
        ' ],',
        ' "checkpoint_id": "ckpt-1",',
        ' "empty": {},',
        ` "instance": "${INSTANCE}",`,
        ` "kind": "${KIND}",`,
        ' "record_count": 1,',
        ` "records_bytes": ${manifest.records_bytes},`,
        ` "records_file": "${manifest.records_file}",`,
        ` "records_sha256": "${manifest.records_sha256}",`,
        ' "schema_version": 1,',
        ' "zeta": "caf\\u00e9 \\ud83d\\ude42"',
        '}',
      ].join('\n'),
    );
    expect(manifest.zeta).toBe('café 🙂');
    expect((await readAll()).manifest).toEqual(manifest);
  });

  test('manifest extras may not override a base key, and nothing is written', async () => {
    await expectStateError(
      write([record('r')], { manifestExtra: { record_count: 7 } }),
      /manifest extra key 'record_count'/,
    );
    expect(await files()).toEqual([]);
  });

  test('an empty export still writes an empty records file and a manifest with record_count 0', async () => {
    const manifest = await write([]);
    expect(manifest.records_sha256).toBe(EMPTY_SHA256);
    expect(manifest.record_count).toBe(0);
    expect(await readFile(join(dir(), `records-${EMPTY_SHA256}.jsonl`), 'utf8')).toBe('');
    expect(await readAll()).toEqual({ manifest, records: [] });
  });

  test('episode_id is written first, as {rollout_id, attempt}, wherever the record holds it', async () => {
    const moved = { z: 1, episode_id: { attempt: 3, rollout_id: 'r' }, a: 2 } as CheckpointRecord;
    const manifest = await write([moved]);
    expect(await readFile(join(dir(), manifest.records_file), 'utf8')).toBe(
      '{"episode_id":{"rollout_id":"r","attempt":3},"z":1,"a":2}\n',
    );
  });

  test('a record line is exactly encodeJson of the record, however large or deep', async () => {
    const boundary = 1 << 15;
    // A surrogate pair straddling the writer's string piece boundary, and escapes around it.
    const long = `${'a"\\\n'.repeat(boundary / 4 - 1)}xyz🙂${'é'.repeat(boundary)}\u0001`;
    const deep = { a: { b: { c: { d: { e: [1, { f: NaN, g: -0, h: 2n ** 70n }] } } } } };
    const wide = Array.from({ length: 3000 }, (_, i) => (i % 2 ? i : `s${i}`));
    const specials = [NaN, -0, 2n ** 70n, null, true, Infinity];
    const tokens = Array.from({ length: 10_000 }, (_, i) => (i % 997 ? i : specials[i % 6]));
    const fields = {
      long,
      deep,
      wide,
      tokens,
      '10': 'integer-like key',
      nested: [[[[[Infinity]]]]],
    };
    const manifest = await write([record('r', 1, fields)]);
    const line = await readFile(join(dir(), manifest.records_file), 'utf8');
    expect(line).toBe(
      `${encodeJson({ episode_id: { rollout_id: 'r', attempt: 1 }, ...fields })}\n`,
    );
  });
});

describe('fields encoded ahead', () => {
  test('a record carrying its fields as JSON pieces is written with the pieces, not its fields', async () => {
    const ahead: CheckpointRecord = {
      episode_id: episodeId('r', 2),
      boundary: { stale: true },
      [RECORD_FIELDS_JSON]: ['"boundary":', '{"step":', '3}'],
    };
    const none: CheckpointRecord = { episode_id: episodeId('s'), [RECORD_FIELDS_JSON]: [] };
    const manifest = await write([ahead, none]);
    expect(await readFile(join(dir(), manifest.records_file), 'utf8')).toBe(
      '{"episode_id":{"rollout_id":"r","attempt":2},"boundary":{"step":3}}\n' +
        '{"episode_id":{"rollout_id":"s","attempt":0}}\n',
    );
    expect((await readAll()).records[0]).toEqual({
      episode_id: { rollout_id: 'r', attempt: 2 },
      boundary: { step: 3 },
    });
  });

  test('property: pieces that are encodeJson of the fields write the same bytes as the fields', async () => {
    // Integer-like keys would come before `episode_id` in a JS object, so the plain path would
    // not write it first; participants' records have none at the top.
    const key = fc.string().filter((k) => k !== 'episode_id' && !/^(0|[1-9][0-9]*)$/.test(k));
    let run = 0;
    await fc.assert(
      fc.asyncProperty(fc.dictionary(key, jsonish, { maxKeys: 4 }), async (fields) => {
        const inner = encodeJson(fields).slice(1, -1);
        const ahead: CheckpointRecord = {
          episode_id: episodeId('r'),
          [RECORD_FIELDS_JSON]: inner === '' ? [] : [inner],
        };
        run += 1;
        const plain = await write([record('r', 0, fields)], {
          checkpointDir: join(root, `a${run}`),
        });
        const pre = await write([ahead], { checkpointDir: join(root, `b${run}`) });
        expect(pre.records_sha256).toBe(plain.records_sha256);
      }),
      { numRuns: 40 },
    );
  });

  test('property: pieces given as UTF-8 bytes, small or large, mixed with text, write the same bytes', async () => {
    const key = fc.string().filter((k) => k !== 'episode_id' && !/^(0|[1-9][0-9]*)$/.test(k));
    // Some values long enough for a piece to be written directly rather than copied.
    const long = fc.string({ unit: 'grapheme', minLength: 20_000, maxLength: 60_000 });
    let run = 0;
    await fc.assert(
      fc.asyncProperty(
        fc.dictionary(key, fc.oneof(jsonish, long), { minKeys: 1, maxKeys: 4 }),
        fc.array(fc.boolean(), { minLength: 4, maxLength: 4 }),
        async (fields, asBytes) => {
          const pieces = Object.entries(fields).map(([k, v], i) => {
            const text = `${i > 0 ? ',' : ''}${JSON.stringify(k)}:${encodeJson(v)}`;
            return asBytes[i] ? Buffer.from(text) : text;
          });
          run += 1;
          const plain = await write([record('r', 0, fields), record('s')], {
            checkpointDir: join(root, `a${run}`),
          });
          const ahead: CheckpointRecord = {
            episode_id: episodeId('r'),
            [RECORD_FIELDS_JSON]: pieces,
          };
          const pre = await write([ahead, record('s')], { checkpointDir: join(root, `b${run}`) });
          expect(pre.records_sha256).toBe(plain.records_sha256);
          expect(pre.records_bytes).toBe(plain.records_bytes);
        },
      ),
      { numRuns: 25 },
    );
  });

  test('byte pieces are written as they are, never decoded and encoded again', async () => {
    // Not UTF-8, so any round trip through a string would change them (to U+FFFD).
    const raw = (size: number) =>
      Buffer.concat([Buffer.from('"b":"'), Buffer.alloc(size, 0xff), Buffer.from('"')]);
    for (const size of [10, 200_000]) {
      const ahead: CheckpointRecord = {
        episode_id: episodeId('r'),
        [RECORD_FIELDS_JSON]: [raw(size)],
      };
      const manifest = await write([ahead], { checkpointDir: join(root, `${size}`) });
      const path = join(
        participantDir(join(root, `${size}`), KIND, INSTANCE),
        manifest.records_file,
      );
      const expected = Buffer.concat([
        Buffer.from('{"episode_id":{"rollout_id":"r","attempt":0},'),
        raw(size),
        Buffer.from('}\n'),
      ]);
      expect((await readFile(path)).equals(expected)).toBe(true);
    }
  });

  test('byte pieces longer than a write buffer, between small ones, are written whole and hashed in order', async () => {
    // 2.5 write buffers of bytes, then many pieces that end across buffer boundaries.
    const long = Buffer.concat([
      Buffer.from('"a":"'),
      Buffer.alloc(5 << 19, 0x78),
      Buffer.from('"'),
    ]);
    const small = Array.from({ length: 3000 }, (_, i) =>
      Buffer.from(`,"m${i}":"${'é'.repeat(i % 700)}"`),
    );
    const ahead: CheckpointRecord = {
      episode_id: episodeId('r'),
      [RECORD_FIELDS_JSON]: [long, ',"t":1', ...small],
    };
    const manifest = await write([ahead, record('s', 0, { v: 1 })]);
    const expected = Buffer.concat([
      Buffer.from('{"episode_id":{"rollout_id":"r","attempt":0},'),
      long,
      Buffer.from(',"t":1'),
      ...small,
      Buffer.from('}\n{"episode_id":{"rollout_id":"s","attempt":0},"v":1}\n'),
    ]);
    expect((await readFile(join(dir(), manifest.records_file))).equals(expected)).toBe(true);
    expect(manifest.records_sha256).toBe(sha256(expected));
    expect(manifest.records_bytes).toBe(expected.length);
  });

  test('a piece longer than a write buffer is written through the buffers, exactly, surrogate pairs whole', async () => {
    // Over 1 MB of UTF-8 in one piece, with two- and four-byte characters across every slice.
    const long = `"s":${JSON.stringify('ab🙂é'.repeat(400_000))}`;
    const ahead: CheckpointRecord = { episode_id: episodeId('r'), [RECORD_FIELDS_JSON]: [long] };
    const from = jest.spyOn(Buffer, 'from');
    try {
      const manifest = await write([ahead, record('s', 0, { v: 1 })]);
      // No copy of the piece into a Buffer of its own: only the reused write buffers hold it.
      const copies = from.mock.calls.filter(([arg]) => typeof arg === 'string' && arg.length > 1e5);
      expect(copies).toHaveLength(0);
      const bytes = await readFile(join(dir(), manifest.records_file));
      const expected = `{"episode_id":{"rollout_id":"r","attempt":0},${long}}\n{"episode_id":{"rollout_id":"s","attempt":0},"v":1}\n`;
      expect(bytes.equals(Buffer.from(expected))).toBe(true);
      expect(manifest.records_sha256).toBe(sha256(expected));
      expect(manifest.records_bytes).toBe(Buffer.byteLength(expected));
    } finally {
      from.mockRestore();
    }
  });
});

describe('round trip', () => {
  test('NaN, ±Infinity, -0, big integers and key order read back exactly', async () => {
    // Decoded, so the integer-like keys keep their place after the others.
    const payload = decodeJson(
      '{"zeta": 1, "alpha": {"nan": NaN, "inf": Infinity, "ninf": -Infinity, "negzero": -0.0,' +
        ' "big": 18446744073709551617}, "list": [NaN, -0.0, 12345678901234567890, "x"],' +
        ' "2": "two", "1": "one"}',
    ) as JsonObject;
    await write([record('r', 0, { payload })]);
    const [restored] = (await readAll()).records;
    const back = (restored as JsonObject).payload as JsonObject;
    const alpha = back.alpha as JsonObject;
    expect(Number.isNaN(alpha.nan)).toBe(true);
    expect(alpha.inf).toBe(Infinity);
    expect(alpha.ninf).toBe(-Infinity);
    expect(Object.is(alpha.negzero, -0)).toBe(true);
    expect(alpha.big).toBe(2n ** 64n + 1n);
    expect(Object.is((back.list as JsonValue[])[1], -0)).toBe(true);
    expect((back.list as JsonValue[])[2]).toBe(12345678901234567890n);
    expect(jsonKeys(back)).toEqual(['zeta', 'alpha', 'list', '2', '1']);
    expect(encodeJson(back)).toBe(encodeJson(payload));
  });

  test('property: any records commit and read back as the same JSON', async () => {
    const records = fc.uniqueArray(
      fc.record({
        rollout: fc.stringMatching(/^[A-Za-z0-9][A-Za-z0-9._]{0,8}$/),
        attempt: fc.nat(5),
        fields: fc.dictionary(
          fc.string().filter((k) => k !== 'episode_id'),
          jsonish,
          { maxKeys: 4 },
        ),
      }),
      { maxLength: 5, selector: (r) => `${r.rollout}/${r.attempt}` },
    );
    let run = 0;
    await fc.assert(
      fc.asyncProperty(records, async (specs) => {
        const checkpointDir = join(root, `run-${run++}`);
        const input = specs.map((s) => record(s.rollout, s.attempt, s.fields));
        const manifest = await writeParticipantState({
          checkpointDir,
          kind: KIND,
          instance: INSTANCE,
          checkpointId: 'p',
          records: input,
        });
        const { records: back } = await readParticipantState({
          checkpointDir,
          kind: KIND,
          instance: INSTANCE,
          select: () => true,
          validate: (r) => r,
        });
        expect(manifest.record_count).toBe(input.length);
        expect(back.map((r) => encodeJson(r))).toEqual(
          input.map(({ episode_id, ...rest }) =>
            encodeJson({
              episode_id: { rollout_id: episode_id.rollout_id, attempt: episode_id.attempt },
              ...rest,
            }),
          ),
        );
      }),
      { numRuns: 40 },
    );
  });

  test('lines longer than a read chunk, and lines across chunk boundaries, read back whole', async () => {
    const big = 'x'.repeat(2_500_000); // larger than a read chunk
    const input = [
      record('big', 0, { big }),
      ...Array.from({ length: 40 }, (_, i) =>
        record(`r${i}`, 0, { text: `${i}`.repeat(70_000 + i) }),
      ),
    ];
    await write(input);
    const { records } = await readAll();
    expect(records).toHaveLength(41);
    expect((records[0] as JsonObject).big).toBe(big);
    expect(records.map((r) => (r.episode_id as JsonObject).rollout_id)).toEqual(
      input.map((r) => r.episode_id.rollout_id),
    );
    expect((records[40] as JsonObject).text).toBe('39'.repeat(70_039));
  });
});

describe('a failed write leaves nothing behind', () => {
  test('a record the codec cannot write names its episode and the value path', async () => {
    const bad = record('r', 1, { session: { messages: [{ text: 'ok' }, { when: new Date(0) }] } });
    await expectStateError(
      write([record('ok'), bad]),
      /checkpoint record of episode 'r-a1' is not JSON: .*Date.* at \$\.session\.messages\[1\]\.when$/,
    );
    expect(await files()).toEqual([]);
  });

  test('a value deeper than the pieces the writer walks keeps its full path', async () => {
    const bad = record('r', 0, { a: { b: { c: { d: { e: [0, new Map()] } } } } });
    await expectStateError(
      write([bad]),
      /episode 'r' is not JSON: .*Map.* at \$\.a\.b\.c\.d\.e\[1\]$/,
    );
    const undef = record('r', 0, { list: [1, undefined] });
    await expectStateError(
      write([undef]),
      /episode 'r' is not JSON: .*undefined.* at \$\.list\[1\]$/,
    );
    expect(await files()).toEqual([]);
  });

  test('a record whose episode_id is not valid is refused', async () => {
    const bad = { episode_id: { rollout_id: 'x-a1', attempt: 2 } } as CheckpointRecord;
    await expectStateError(write([bad]), /no valid episode_id/);
    expect(await files()).toEqual([]);
  });

  test("the export's own error passes through unchanged", async () => {
    const boom = new Error('export failed');
    async function* records() {
      yield record('r');
      throw boom;
    }
    await expect(write(records())).rejects.toBe(boom);
    expect(await files()).toEqual([]);
  });

  test('a directory that cannot hold state is a typed error naming it', async () => {
    const file = join(root, 'file.txt');
    await writeFile(file, 'not a directory');
    const checkpointDir = join(file, 'sub');
    const err = writeParticipantState({
      checkpointDir,
      kind: KIND,
      instance: INSTANCE,
      checkpointId: 'c',
      records: [record('r')],
    });
    await expectStateError(
      err,
      `cannot write checkpoint state under ${join(checkpointDir, 'gym', KIND, INSTANCE)}`,
    );
    await expectStateError(
      readParticipantState({
        checkpointDir,
        kind: KIND,
        instance: INSTANCE,
        select: () => true,
        validate: (r) => r,
      }),
      /missing manifest|cannot read checkpoint state/,
    );
  });

  test.each(['', '.', '..', '../x', 'a/b', 'a\n', '-a', 'a b', '.hidden'])(
    'the unsafe name %j is refused as a kind and as an instance',
    async (name) => {
      expect(() => participantDir(root, name, 'i')).toThrow(CheckpointStateError);
      await expectStateError(
        write([record('r')], { kind: name }),
        /participant kind .* is not a safe path component/,
      );
      await expectStateError(
        write([record('r')], { instance: name }),
        /participant instance .* is not a safe path component/,
      );
      await expectStateError(readAll({ instance: name }), /not a safe path component/);
      expect(await readdir(root)).toEqual([]);
    },
  );
});

describe('stopping a write', () => {
  test('a write stopped before it starts is refused and writes nothing', async () => {
    const stop = new WriteStop();
    await stop.stop();
    expect(stop.stopped).toBe(true);
    await expectStateError(
      write([record('r')], { stop }),
      /checkpoint "ckpt-1" was resumed before its write finished/,
    );
    expect(await files()).toEqual([]);
  });

  test('once stop() resolves mid-stream, no manifest ever appears and no further record is taken', async () => {
    const stop = new WriteStop();
    let release!: () => void;
    const released = new Promise<void>((resolve) => (release = resolve));
    const taken: string[] = [];
    async function* slow() {
      for (const id of ['a', 'b', 'c', 'd']) {
        if (id === 'b') await released;
        taken.push(id);
        yield record(id, 0, { x: 'y'.repeat(1000) });
      }
    }
    const writing = write(slow(), { stop });
    while (taken.length === 0) await new Promise((resolve) => setImmediate(resolve));
    await stop.stop();
    release();
    await expectStateError(writing, /was resumed before its write finished/);
    expect(taken).toEqual(['a', 'b']);
    expect(await files()).toEqual([]);
  });

  test('a stop after the last record but before the publish still prevents the manifest', async () => {
    const stop = new WriteStop();
    let stopped: Promise<void> | undefined;
    async function* records() {
      yield record('a');
      yield record('b');
      stopped = stop.stop(); // the export is done; the write has yet to sync and publish
    }
    const writing = write(records(), { stop });
    await expectStateError(writing, /was resumed before its write finished/);
    await stopped;
    expect(await files()).toEqual([]);
  });

  test('stop() waits for a publish already under the lock', async () => {
    const stop = new WriteStop();
    let finishPublish!: () => void;
    const publishing = stop.locked(() => new Promise<void>((resolve) => (finishPublish = resolve)));
    let stopReturned = false;
    const stopping = stop.stop().then(() => (stopReturned = true));
    await new Promise((resolve) => setImmediate(resolve));
    expect(stop.stopped).toBe(true);
    expect(stopReturned).toBe(false);
    finishPublish();
    await publishing;
    await stopping;
    expect(stopReturned).toBe(true);
  });

  test('stop racing the publish: whether a manifest exists is settled when stop() resolves', async () => {
    const outcomes = new Set<string>();
    for (let delay = 0; delay < 12; delay++) {
      const checkpointDir = join(root, `race-${delay}`);
      const stop = new WriteStop();
      const writing = writeParticipantState({
        checkpointDir,
        kind: KIND,
        instance: INSTANCE,
        checkpointId: 'c',
        records: Array.from({ length: 20 }, (_, i) =>
          record(`r${i}`, 0, { x: 'z'.repeat(20_000) }),
        ),
        stop,
      });
      const settled = writing.then(
        () => 'published',
        (err: unknown) => (err instanceof CheckpointStateError ? 'stopped' : String(err)),
      );
      for (let i = 0; i < delay; i++) await new Promise((resolve) => setImmediate(resolve));
      await stop.stop();
      const manifestPath = join(participantDir(checkpointDir, KIND, INSTANCE), MANIFEST_FILE);
      const atStop = existsSync(manifestPath);
      const outcome = await settled;
      expect(existsSync(manifestPath)).toBe(atStop);
      expect(outcome).toBe(atStop ? 'published' : 'stopped');
      outcomes.add(outcome);
    }
    expect(outcomes.has('stopped')).toBe(true);
  });
});

describe('a directory that already holds a manifest', () => {
  test('an identical re-commit returns the existing manifest', async () => {
    const records = [record('r', 0, { n: NaN }), record('s')];
    const first = await write(records, { manifestExtra: { generation: 3 } });
    const again = await write(records, { manifestExtra: { generation: 3 } });
    expect(again).toEqual(first);
    expect(await files()).toEqual([MANIFEST_FILE, first.records_file]);
  });

  test('a different commit is refused and leaves no stray records file', async () => {
    const first = await write([record('r', 0, { v: 1 })]);
    const manifestText = await readFile(join(dir(), MANIFEST_FILE), 'utf8');
    await expectStateError(
      write([record('r', 0, { v: 2 })], { checkpointId: 'ckpt-2' }),
      `${join(dir(), MANIFEST_FILE)} already holds a different commit`,
    );
    expect(await files()).toEqual([MANIFEST_FILE, first.records_file]);
    expect(await readFile(join(dir(), MANIFEST_FILE), 'utf8')).toBe(manifestText);
  });

  test('the same records under another checkpoint id are refused and keep the published records file', async () => {
    const first = await write([record('r')]);
    await expectStateError(
      write([record('r')], { checkpointId: 'ckpt-2' }),
      /already holds a different commit/,
    );
    await expectStateError(
      write([record('r')], { manifestExtra: { extra: true } }),
      /already holds a different commit/,
    );
    expect(await files()).toEqual([MANIFEST_FILE, first.records_file]);
    expect((await readAll()).manifest).toEqual(first);
  });
});

describe('reading', () => {
  const manifestPath = () => join(dir(), MANIFEST_FILE);
  const line = (rolloutId: string, attempt = 0, rest = '') =>
    `{"episode_id":{"rollout_id":"${rolloutId}","attempt":${attempt}}${rest}}`;

  test('reads the state back with its manifest, keeping only the records in scope', async () => {
    const manifest = await write([
      record('a', 0, { v: 1 }),
      record('b', 1, { v: 2 }),
      record('c', 0, { v: 3 }),
    ]);
    const seen: [string, EpisodeId][] = [];
    const { manifest: read, records } = await readAll({
      select: (key, episode) => {
        seen.push([key, episode]);
        return key !== 'b-a1';
      },
      validate: (r, key) => ({ key, v: r.v }),
    });
    expect(read).toEqual(manifest);
    expect(records).toEqual([
      { key: 'a', v: 1 },
      { key: 'c', v: 3 },
    ]);
    expect(seen).toEqual([
      ['a', { rollout_id: 'a', attempt: 0 }],
      ['b-a1', { rollout_id: 'b', attempt: 1 }],
      ['c', { rollout_id: 'c', attempt: 0 }],
    ]);
  });

  test.each<[string, (path: string) => Promise<unknown>, RegExp]>([
    ['missing', (p) => rm(p), /^missing manifest .*manifest\.json$/],
    ['not JSON', (p) => writeFile(p, '{"schema_version": 1,'), /manifest\.json is not JSON/],
    ['not an object', (p) => writeFile(p, '[1]'), /manifest\.json is not a manifest$/],
    [
      'of another schema',
      (p) => patchManifest(p, { schema_version: 2 }),
      /has unsupported schema 2/,
    ],
    [
      'of another kind',
      (p) => patchManifest(p, { kind: 'model' }),
      /belongs to "model"\/"simple_agent"/,
    ],
    ['of another instance', (p) => patchManifest(p, { instance: 'x' }), /belongs to "agent"\/"x"/],
    [
      'without checkpoint_id',
      (p) => patchManifest(p, { checkpoint_id: 5 }),
      /names no checkpoint$/,
    ],
    [
      'naming ../x',
      (p) => patchManifest(p, { records_file: '../x' }),
      /names an invalid records file "\.\.\/x"/,
    ],
    [
      'naming a short digest',
      (p) => patchManifest(p, { records_file: 'records-abc.jsonl' }),
      /invalid records file/,
    ],
    [
      'naming another file',
      (p) => patchManifest(p, { records_file: 'manifest.json' }),
      /invalid records file/,
    ],
    [
      'naming a missing file',
      (p) => patchManifest(p, { records_file: `records-${'0'.repeat(64)}.jsonl` }),
      /cannot read checkpoint state from .*ENOENT/,
    ],
    [
      'without a digest',
      (p) => patchManifest(p, { records_sha256: null }),
      /names no records digest/,
    ],
    ['without a count', (p) => patchManifest(p, { record_count: '1' }), /names no record count/],
  ])('a manifest %s is a typed error naming the file', async (_name, corrupt, detail) => {
    await write([record('r')]);
    await corrupt(manifestPath());
    await expectStateError(readAll(), detail);
  });

  async function patchManifest(path: string, patch: Record<string, unknown>): Promise<void> {
    const manifest = JSON.parse(await readFile(path, 'utf8')) as Record<string, unknown>;
    await writeFile(path, JSON.stringify({ ...manifest, ...patch }));
  }

  test('a records file that does not match its digest is refused', async () => {
    const manifest = await write([record('r', 0, { v: 'aaaa' })]);
    const path = join(dir(), manifest.records_file);
    await writeFile(path, (await readFile(path, 'utf8')).replace('aaaa', 'aaab'));
    await expectStateError(readAll(), `${path} does not match its manifest digest`);
  });

  test('a record count that does not match is refused', async () => {
    await write([record('r'), record('s')]);
    await patchManifest(manifestPath(), { record_count: 3 });
    await expectStateError(readAll(), /expects 3 records, found 2$/);
  });

  test.each([
    ['a blank line', Buffer.from('')],
    [
      'a line that is not JSON',
      Buffer.from('{"episode_id": {"rollout_id": "r", "attempt": 0}, "x": }'),
    ],
    [
      'a truncated canonical line',
      Buffer.from('{"episode_id":{"rollout_id":"r","attempt":0},"x":'),
    ],
    [
      'a line that is not UTF-8',
      Buffer.from([
        ...Buffer.from('{"episode_id":{"rollout_id":"r","attempt":0},"x":"'),
        0xff,
        0x22,
        0x7d,
      ]),
    ],
  ])('%s is a record that is not JSON', async (_name, bad) => {
    await handWritten(
      Buffer.concat([Buffer.from(`${line('a')}\n`), bad, Buffer.from(`\n${line('b')}\n`)]),
    );
    await expectStateError(readAll(), /holds a record that is not JSON \(line 2\)/);
  });

  test.each([
    ['missing', '{"x": 1}'],
    ['not an object', '[1, 2]'],
    ['with a reserved suffix', line('x-a1', 1)],
    ['with a negative attempt', '{"episode_id": {"rollout_id": "r", "attempt": -1}}'],
    ['with an unknown key', '{"episode_id": {"rollout_id": "r", "attempt": 0, "extra": 1}}'],
  ])('a record with an episode_id %s is refused, in scope or not', async (_name, bad) => {
    await handWritten([line('a'), bad]);
    await expectStateError(
      readAll({ select: () => false }),
      /checkpoint record \(line 2 of .*\) has no valid episode_id/,
    );
  });

  test('an in-scope record that fails validation names its episode', async () => {
    await write([record('a'), record('b', 2, { v: 'bad' })]);
    await expectStateError(
      readAll({
        validate: (r) => {
          if (r.v === 'bad') throw new Error('v must be a number');
          return r;
        },
      }),
      "checkpoint record of episode 'b-a2' is invalid: v must be a number",
    );
  });

  test('out-of-scope records are not validated, yet still counted and digested', async () => {
    const manifest = await write([
      record('in', 0, { v: 1 }),
      record('out', 0, { v: 'never validated' }),
    ]);
    const validate = jest.fn((r: JsonObject, _key: string) => r);
    const { records } = await readAll({ select: (key) => key === 'in', validate });
    expect(records).toHaveLength(1);
    expect(validate).toHaveBeenCalledTimes(1);
    expect(validate.mock.calls[0]?.[1]).toBe('in');

    // The digest and the count cover the out-of-scope record too.
    const path = join(dir(), manifest.records_file);
    await writeFile(path, (await readFile(path, 'utf8')).replace('never', 'NEVER'));
    await expectStateError(
      readAll({ select: (key) => key === 'in', validate }),
      /does not match its manifest digest/,
    );
    await writeFile(path, (await readFile(path, 'utf8')).replace('NEVER', 'never'));
    await patchManifest(manifestPath(), { record_count: 1 });
    await expectStateError(
      readAll({ select: (key) => key === 'in', validate }),
      /expects 1 records, found 2/,
    );
  });

  test('a problem in a line is reported before a digest mismatch', async () => {
    await handWritten([line('a'), 'not json'], { records_sha256: '0'.repeat(64) });
    await expectStateError(readAll(), /holds a record that is not JSON \(line 2\)/);
  });

  test('reads a file written by Python: ", " separators, \\uXXXX escapes, NaN, legacy records.jsonl', async () => {
    await handWritten(
      [
        '{"episode_id": {"rollout_id": "r", "attempt": 1}, "text": "caf\\u00e9 \\ud83d\\ude42", "score": NaN, "n": [1, -Infinity]}',
        '{"episode_id": {"rollout_id": "s", "attempt": 0}, "big": 123456789012345678901}',
      ],
      {},
      'records.jsonl',
    );
    const { manifest, records } = await readAll();
    expect(manifest.records_file).toBe('records.jsonl');
    const [r, s] = records as [JsonObject, JsonObject];
    expect(r.text).toBe('café 🙂');
    expect(Number.isNaN(r.score)).toBe(true);
    expect(r.n).toEqual([1, -Infinity]);
    expect(s.big).toBe(123456789012345678901n);
  });

  test('an episode_id that is not at the start of its line is still found', async () => {
    await handWritten(['{"x": 1, "episode_id": {"attempt": 2, "rollout_id": "r"}}', line('s')]);
    const select = jest.fn((key: string) => key === 'r-a2');
    const { records } = await readAll({ select });
    expect(select.mock.calls.map((call) => call[0])).toEqual(['r-a2', 's']);
    expect(records).toEqual([{ x: 1, episode_id: { attempt: 2, rollout_id: 'r' } }]);
  });

  test('an out-of-scope record whose line starts in the canonical or Python form is not decoded', async () => {
    await handWritten([
      line('in'),
      '{"episode_id":{"rollout_id":"out","attempt":0},"x": not JSON',
      '{"episode_id": {"rollout_id": "out", "attempt": 1}, "x": nor this',
    ]);
    expect((await readAll({ select: (key) => key === 'in' })).records).toHaveLength(1);
    // In scope, the same lines are decoded and refused.
    await expectStateError(readAll({ select: (key) => key === 'out' }), /not JSON \(line 2\)/);
    await expectStateError(readAll({ select: (key) => key === 'out-a1' }), /not JSON \(line 3\)/);
  });

  test('a last line without a newline is still a record', async () => {
    await handWritten(`${line('a')}\n${line('b')}`);
    expect((await readAll()).records).toHaveLength(2);
  });
});

describe('decoding on use (readRawParticipantState)', () => {
  const line = (rolloutId: string, attempt = 0, rest = '') =>
    `{"episode_id":{"rollout_id":"${rolloutId}","attempt":${attempt}}${rest}}`;
  const readRaw = (select: (key: string) => boolean = () => true) =>
    readRawParticipantState<RawRecord>({
      checkpointDir: root,
      kind: KIND,
      instance: INSTANCE,
      select,
      validate: (r) => r,
    });
  const captureKeyOf = (r: RawRecord) => captureKey(r.episode_id);

  test('gives each in-scope record its episode and line, and decode() what the eager read gives', async () => {
    await write([record('a', 0, { v: [1, NaN] }), record('b', 2, { s: 'café' }), record('c')]);
    const eager = (await readAll()).records;
    const { records } = await readRaw((key) => key !== 'c');
    expect(records.map((r) => r.episode_id)).toEqual([episodeId('a', 0), episodeId('b', 2)]);
    expect(records.map((r) => r.bytes.toString('utf8'))).toEqual(
      eager.slice(0, 2).map((r) => encodeJson(r)),
    );
    const first = records[0] as RawRecord;
    expect(first.decode()).toEqual(eager[0]);
    expect(first.decode()).toBe(first.decode()); // decoded once
  });

  test('every line read undecoded stays its own after the read, in a file of several read chunks', async () => {
    // About 2.5 read chunks of records, each its own text: a read that reused its chunk buffers
    // under the lines it kept would leave earlier lines holding later bytes.
    const input = Array.from({ length: 60 }, (_, i) =>
      record(`r${i}`, 0, { text: String.fromCharCode(97 + (i % 26)).repeat(90_000 + i) }),
    );
    await write(input);
    const { records } = await readRaw();
    expect(records.map((r) => r.decode())).toEqual(input);
  });

  test('a payload that is not JSON restores, and its decode() is a typed error naming the episode', async () => {
    await handWritten([line('good', 0, ',"v":1'), line('bad', 1, ',"v": not JSON')]);
    // The eager read refuses the file; the raw one has verified everything but the payload.
    await expectStateError(readAll(), /not JSON \(line 2\)/);
    const { records } = await readRaw();
    expect(records.map((r) => captureKeyOf(r))).toEqual(['good', 'bad-a1']);
    expect((records[0] as RawRecord).decode()).toEqual({ episode_id: episodeId('good'), v: 1 });
    const bad = records[1] as RawRecord;
    expect(() => bad.decode()).toThrow(CheckpointStateError);
    expect(() => bad.decode()).toThrow(/checkpoint record of episode 'bad-a1' is not JSON/);
    expect(() => bad.decode()).toThrow(
      expect.objectContaining({ code: 'invalid_checkpoint_state' }),
    );
  });

  test('field() decodes one top-level field alone: a broken payload leaves the small fields readable', async () => {
    // The payload's brackets match, so its end is found; its text is not JSON.
    await handWritten([line('r', 1, ',"session_key":"k1","session":{"m": [not JSON]},"n":[1, 2]')]);
    const [raw] = (await readRaw()).records as [RawRecord];
    expect(raw.field('session_key')).toBe('k1');
    expect(raw.field('n')).toEqual([1, 2]);
    expect(raw.field('absent')).toBeUndefined();
    expect(raw.fieldNames()).toEqual(['episode_id', 'session_key', 'session', 'n']);
    expect(() => raw.field('session')).toThrow(/checkpoint record of episode 'r-a1' is not JSON/);
    expect(() => raw.decode()).toThrow(CheckpointStateError);
  });

  test('fieldsBefore() reads the fields ahead of a payload without reading the payload or anything after it', async () => {
    // Not even the payload's structure is sound: a scan of it would fail.
    await handWritten([line('r', 1, ',"session_key":"k1","__proto__":{"o":1},"session":{"m": [}')]);
    const [raw] = (await readRaw()).records as [RawRecord];
    const head = raw.fieldsBefore('session')!;
    expect(Object.keys(head)).toEqual(['episode_id', 'session_key', '__proto__']);
    expect(head.session_key).toBe('k1');
    expect(Object.getPrototypeOf(head)).toBe(Object.prototype); // an own field, not the prototype
    expect(() => raw.fieldNames()).toThrow(/episode 'r-a1' is not JSON/);
  });

  test('fieldsBefore() a name the record lacks is undefined; decoded first, it reads the decoded record', async () => {
    await handWritten([line('r', 1, ',"a":1,"b":[2]')]);
    const [raw] = (await readRaw()).records as [RawRecord];
    expect(raw.fieldsBefore('absent')).toBeUndefined();
    expect(raw.fieldsBefore('b')).toEqual({ episode_id: episodeId('r', 1), a: 1 });
    raw.decode();
    expect(raw.fieldsBefore('absent')).toBeUndefined();
    expect(raw.fieldsBefore('b')).toEqual({ episode_id: episodeId('r', 1), a: 1 });
  });

  test('fieldsBefore() several names stops at the first field keyed any of them', async () => {
    await handWritten([line('r', 1, ',"a":1,"b":{"m": [},"c":2')]);
    const [raw] = (await readRaw()).records as [RawRecord];
    expect(raw.fieldsBefore('c', 'b')).toEqual({ episode_id: episodeId('r', 1), a: 1 });
    expect(raw.fieldsBefore('absent', 'a')).toEqual({ episode_id: episodeId('r', 1) });
  });

  test("fieldBytes() gives a top-level field's text as it lies in the record, decoded or not", async () => {
    await handWritten([line('r', 1, ',"session_key":"k1","session":{"m": [not JSON]},"n":[1, 2]')]);
    const [raw] = (await readRaw()).records as [RawRecord];
    expect(raw.fieldBytes('session')?.toString()).toBe('{"m": [not JSON]}');
    expect(raw.fieldBytes('n')?.toString()).toBe('[1, 2]');
    expect(raw.fieldBytes('absent')).toBeUndefined();
  });

  test("fieldElements() gives an array field's elements as their texts; not an array is a typed error", async () => {
    await handWritten([line('r', 1, ',"rows":[ {"a": [1, "]"]} , {},3 ],"n":{"x":1}')]);
    const [raw] = (await readRaw()).records as [RawRecord];
    expect(raw.fieldElements('rows')?.map((b) => b.toString())).toEqual([
      '{"a": [1, "]"]}',
      '{}',
      '3',
    ]);
    expect(raw.fieldElements('absent')).toBeUndefined();
    expect(() => raw.fieldElements('n')).toThrow(/episode 'r-a1' is not JSON: expected an array/);
  });

  test('property: field(k) is decode()[k] for every field, before or after decode()', async () => {
    const key = fc.string().filter((k) => k !== 'episode_id' && !/^(0|[1-9][0-9]*)$/.test(k));
    let run = 0;
    await fc.assert(
      fc.asyncProperty(fc.dictionary(key, jsonish, { maxKeys: 5 }), async (fields) => {
        run += 1;
        const checkpointDir = join(root, `p${run}`);
        await write([record('r', 0, fields)], { checkpointDir });
        const read = () =>
          readRawParticipantState<RawRecord>({
            checkpointDir,
            kind: KIND,
            instance: INSTANCE,
            select: () => true,
            validate: (r) => r,
          });
        const [lazy] = (await read()).records as [RawRecord];
        const [eager] = (await read()).records as [RawRecord];
        const whole = eager.decode();
        expect(lazy.fieldNames()).toEqual(Object.keys(whole));
        for (const k of Object.keys(whole)) {
          expect(lazy.field(k)).toEqual(whole[k]);
          expect(eager.field(k)).toEqual(whole[k]);
        }
        expect(lazy.decode()).toEqual(whole);
      }),
      { numRuns: 40 },
    );
  });

  test('bytes that are not UTF-8 are refused by decode(), not read as replacement characters', async () => {
    await handWritten(
      Buffer.concat([
        Buffer.from(line('r', 0, ',"s":"')),
        Buffer.from([0xff]),
        Buffer.from('"}\n'),
      ]),
    );
    const [raw] = (await readRaw()).records as [RawRecord];
    expect(() => raw.decode()).toThrow(/episode 'r' is not JSON: it is not UTF-8/);
  });

  test('the checks before it resolves stay: digest, count, every episode once, a valid episode', async () => {
    await handWritten([line('a'), line('b')], { records_sha256: '0'.repeat(64) });
    await expectStateError(readRaw(), /does not match its manifest digest/);
    await handWritten([line('a'), line('b')], { record_count: 3 });
    await expectStateError(readRaw(), /expects 3 records, found 2/);
    await handWritten([line('a'), line('b', 0, ',"x": broken'), line('a')]);
    await expectStateError(
      readRaw((key) => key === 'b'),
      /holds episode 'a' twice/,
    );
    await handWritten([line('a'), '{"episode_id":{"rollout_id":"","attempt":0}}']);
    await expectStateError(readRaw(), /no valid episode_id/);
  });

  test('a line that does not start with its episode is decoded at read, and refused there if broken', async () => {
    await handWritten(['{"x": 1, "episode_id": {"attempt": 2, "rollout_id": "r"}}']);
    const [raw] = (await readRaw()).records as [RawRecord];
    expect(captureKeyOf(raw)).toBe('r-a2');
    expect(raw.decode()).toEqual({ x: 1, episode_id: { attempt: 2, rollout_id: 'r' } });
    await handWritten(['{"x": broken, "episode_id": {"attempt": 2, "rollout_id": "r"}}']);
    await expectStateError(readRaw(), /not JSON \(line 1\)/);
  });
});

describe('JSON in pieces', () => {
  const pieces = (value: unknown, wholeChars?: number) => {
    const parts: string[] = [];
    encodeJsonPieces(value, { put: (text) => parts.push(text) }, wholeChars);
    return parts;
  };
  /** What decoding gives, compared through the codec (exact for NaN, -0, key order), or the failure. */
  const outcome = (decode: () => JsonValue) => {
    try {
      return `value ${encodeJson(decode())}`;
    } catch (err) {
      return `error ${(err as Error).name}`;
    }
  };

  test('property: the pieces written are exactly encodeJson', () => {
    fc.assert(
      fc.property(jsonish, (value) => {
        expect(pieces(value).join('')).toBe(encodeJson(value));
      }),
      { numRuns: 300 },
    );
  });

  test('property: the pieces are exactly encodeJson whatever size is written whole', () => {
    fc.assert(
      fc.property(jsonish, fc.constantFrom(0, 1, 8, 40), (value, wholeChars) => {
        expect(pieces(value, wholeChars).join('')).toBe(encodeJson(value));
      }),
      { numRuns: 300 },
    );
  });

  test('a record of a few KB is written as one piece, not one per member', () => {
    const message = (i: number) => ({ role: 'user', content: `turn ${i} `.repeat(20), n: [i, -0] });
    const value = {
      episode_id: { rollout_id: 'r', attempt: 0 },
      session: { messages: [0, 1, 2].map(message) },
    };
    expect(encodeJson(value).length).toBeGreaterThan(500);
    expect(pieces(value)).toEqual([encodeJson(value)]);
    // Below its size the same record is split (the behaviour large records keep).
    expect(pieces(value, 100).length).toBeGreaterThan(1);
    expect(pieces(value, 100).join('')).toBe(encodeJson(value));
  });

  test('a value the codec refuses inside a split piece is named by its full path', () => {
    const bad = { a: { b: [1, { c: { d: { e: [0, new Map()] } } }] } };
    expect(() => pieces(bad, 0)).toThrow(/Map at \$\.a\.b\[1\]\.c\.d\.e\[1\]$/);
    expect(() => pieces(bad)).toThrow(/Map at \$\.a\.b\[1\]\.c\.d\.e\[1\]$/);
  });

  test('no piece is longer than a string piece, however long the strings', () => {
    const straddling = `${'x'.repeat((1 << 15) - 1)}🙂${'x'.repeat(200_000)}`; // a pair across a boundary
    const value = { a: [straddling, { b: { c: 'y'.repeat(70_000) } }] };
    const parts = pieces(value);
    expect(parts.join('')).toBe(encodeJson(value));
    expect(Math.max(...parts.map((part) => part.length))).toBeLessThanOrEqual((1 << 15) + 2);
  });

  test('property: decoding in pieces gives what decodeJson gives, for any piece size', () => {
    fc.assert(
      fc.property(jsonish, fc.constantFrom(1, 8, 40, 300), (value, pieceBytes) => {
        const text = encodeJson(value);
        const bytes = Buffer.from(text);
        expect(outcome(() => decodeJsonPieces(bytes, 0, bytes.length, pieceBytes))).toBe(
          outcome(() => decodeJson(text)),
        );
      }),
      { numRuns: 400 },
    );
  });

  test('property: texts with whitespace, and broken texts, are read or refused as decodeJson does', () => {
    const broken = fc.tuple(
      fc.jsonValue(),
      fc.nat(),
      fc.constantFrom('', '{', '}', '[', ']', ',', ':', '"', ' ', '\\', '0', 'x'),
      fc.boolean(),
    );
    fc.assert(
      fc.property(broken, fc.constantFrom(1, 8, 40), ([value, at, insert, remove], pieceBytes) => {
        const spaced = JSON.stringify(value, null, 1);
        const i = at % (spaced.length + 1);
        const text = spaced.slice(0, i) + insert + spaced.slice(remove ? i + 1 : i);
        const bytes = Buffer.from(` ${text}\t`);
        expect(outcome(() => decodeJsonPieces(bytes, 0, bytes.length, pieceBytes))).toBe(
          outcome(() => decodeJson(` ${text}\t`)),
        );
      }),
      { numRuns: 600 },
    );
  });

  test('a large object keeps key order, an own __proto__ and the last of duplicate keys', () => {
    const big = (c: string) => `"${c.repeat(50)}"`;
    const text = `{"b":${big('b')},"__proto__":${big('p')},"10":[${big('t')}],"2":1,"b":2,"a":{"x":${big('x')}},"2":${big('2')}}`;
    const bytes = Buffer.from(text);
    const value = decodeJsonPieces(bytes, 0, bytes.length, 16) as JsonObject;
    expect(encodeJson(value)).toBe(encodeJson(decodeJson(text)));
    expect(Object.getPrototypeOf(value)).toBe(Object.prototype);
    expect(Object.getOwnPropertyDescriptor(value, '__proto__')?.value).toBe('p'.repeat(50));
    expect(value.b).toBe(2);
    expect(value['2']).toBe('2'.repeat(50));
    expect(jsonKeys(value)).toEqual(jsonKeys(decodeJson(text) as JsonObject));

    // A later duplicate small enough to stay in the skeleton still wins over a deferred one.
    const duplicate = Buffer.from(`{"b":${big('b')},"b":2}`);
    expect(decodeJsonPieces(duplicate, 0, duplicate.length, 40)).toEqual({ b: 2 });
  });
});

describe('durability', () => {
  test('the directories to sync are every parent of the participant directory up to checkpoint_dir', () => {
    expect(parentsUpTo(participantDir('/ck', 'agent', 'a1'), '/ck')).toEqual([
      '/ck/gym/agent',
      '/ck/gym',
      '/ck',
    ]);
    expect(parentsUpTo('/ck', '/ck')).toEqual([]);
    expect(parentsUpTo('/elsewhere/x', '/ck')).toEqual([]);
  });
});

describe('two processes', () => {
  let storeModule: string;

  beforeAll(async () => {
    storeModule = await transpileForChildren(join(here, '..', 'src', 'store.ts'));
  });
  afterAll(async () => {
    if (storeModule) await rm(dirname(storeModule), { recursive: true, force: true });
  });

  async function race(tags: [string, string], checkpointDir: string) {
    const startAt = Date.now() + 400; // both start their write together, after their imports
    const runs = tags.map(
      (tag) =>
        new Promise<{ ok: boolean; code?: string; message?: string; manifest?: Manifest }>(
          (resolve, reject) => {
            const child = spawn(
              process.execPath,
              [
                join(here, 'fixtures', 'race-writer.mjs'),
                storeModule,
                checkpointDir,
                tag,
                String(startAt),
              ],
              { stdio: ['ignore', 'pipe', 'inherit'] },
            );
            let out = '';
            child.stdout.on('data', (chunk: Buffer) => (out += chunk.toString()));
            child.on('error', reject);
            child.on('close', (code) =>
              code === 0
                ? resolve(JSON.parse(out))
                : reject(new Error(`race writer exited ${code}: ${out}`)),
            );
          },
        ),
    );
    return Promise.all(runs);
  }

  test('two writers racing to publish leave exactly one manifest and one records file', async () => {
    for (let round = 0; round < 2; round++) {
      const checkpointDir = join(root, `round-${round}`);
      const results = await race(['one', 'two'], checkpointDir);
      const winners = results.filter((r) => r.ok);
      const losers = results.filter((r) => !r.ok);
      expect(winners).toHaveLength(1);
      expect(losers).toHaveLength(1);
      expect(losers[0]?.code).toBe('invalid_checkpoint_state');
      expect(losers[0]?.message).toMatch(/already holds a different commit/);
      const participant = participantDir(checkpointDir, KIND, 'race');
      const left = (await readdir(participant)).sort();
      const manifest = winners[0]?.manifest as Manifest;
      expect(left).toEqual([MANIFEST_FILE, manifest.records_file]);
      const { records } = await readParticipantState({
        checkpointDir,
        kind: KIND,
        instance: 'race',
        select: () => true,
        validate: (r) => r,
      });
      expect(records).toHaveLength(manifest.record_count);
    }
  });

  test('two writers racing with the same commit both return the one manifest', async () => {
    const checkpointDir = join(root, 'same');
    const results = await race(['same', 'same'], checkpointDir);
    expect(results.map((r) => r.ok)).toEqual([true, true]);
    expect(results[0]?.manifest).toEqual(results[1]?.manifest);
    const participant = participantDir(checkpointDir, KIND, 'race');
    expect((await readdir(participant)).sort()).toEqual([
      MANIFEST_FILE,
      results[0]?.manifest?.records_file,
    ]);
  });
});

/**
 * Child processes cannot use jest's transform: transpile `entry` and the modules it imports
 * (relative `./x.js` imports of `./x.ts`) into a temporary ESM directory, and return the entry's
 * path there.
 */
async function transpileForChildren(entry: string): Promise<string> {
  const { transformFile } = (await import('@swc/core')) as typeof import('@swc/core');
  const out = await mkdtemp(join(tmpdir(), 'ckpt-gym-store-child-'));
  await writeFile(join(out, 'package.json'), '{"type": "module"}');
  // Packages the sources import resolve from the repository's node_modules.
  await symlink(join(here, '..', '..', '..', 'node_modules'), join(out, 'node_modules'));
  const srcDir = dirname(entry);
  const pending = [entry];
  const done = new Set<string>();
  while (pending.length > 0) {
    const file = pending.pop() as string;
    if (done.has(file)) continue;
    done.add(file);
    const { code } = await transformFile(file, {
      jsc: { parser: { syntax: 'typescript' }, target: 'es2022' },
      module: { type: 'es6' },
    });
    await writeFile(join(out, relative(srcDir, file).replace(/\.ts$/, '.js')), code);
    for (const match of code.matchAll(/from\s+['"](\.\/[\w-]+)\.js['"]/g)) {
      pending.push(join(srcDir, `${match[1]}.ts`));
    }
  }
  expect((await stat(join(out, 'store.js'))).isFile()).toBe(true);
  return join(out, 'store.js');
}

function joined(pieces: readonly (string | Uint8Array)[]): string {
  return Buffer.concat(pieces.map((p) => (typeof p === 'string' ? Buffer.from(p) : p))).toString();
}

/** A session as an agent holds it: its messages appended (encoded) one by one. */
function session(messages: readonly JsonValue[], extra: JsonValue): Record<string, JsonValue> {
  const list: JsonValue[] = [];
  for (const message of messages) appendEncoded(list, message);
  return { model: 'policy', messages: list, extra: encodeOnce(extra) };
}

describe('encodeJsonBytes', () => {
  test('property: the pieces join to exactly encodeJson of the value, with values encoded once and lists appended to inside', () => {
    fc.assert(
      fc.property(fc.array(jsonish, { maxLength: 6 }), jsonish, (messages, extra) => {
        const held = () => session(messages as JsonValue[], extra as JsonValue);
        const value = { outer: [held()], top: held() };
        expect(joined(encodeJsonBytes(value))).toBe(encodeJson(value));
      }),
      { numRuns: 200 },
    );
  });

  test('NaN, -Infinity, -0 and big integers in appended messages are written as the codec writes them', () => {
    const list = appendOnly<JsonValue>([]);
    appendEncoded(list, { score: NaN, low: -Infinity, zero: -0, id: 2n ** 64n + 1n });
    list.push({ seed: 12345678901234567890n, ratio: 1e300 }); // pushed without encoding: still exact
    appendEncoded(list, [Infinity, 'é🙂']);
    const text = joined(encodeJsonBytes({ messages: list }));
    expect(text).toBe(encodeJson({ messages: list }));
    expect(text).toContain('"score":NaN,"low":-Infinity,"zero":-0.0,"id":18446744073709551617');
    expect(decodeJson(text)).toEqual({ messages: list });
    expect(decodeJsonPieces(Buffer.from(text))).toEqual({ messages: list });
  });

  test('an appended message is encoded when it is added, and its bytes are what every later write uses', () => {
    const list: JsonValue[] = [];
    const message: Record<string, JsonValue> = { role: 'user', content: 'hello' };
    appendEncoded(list, message);
    // Against the contract, on purpose: a change after the append shows the kept bytes are used.
    message.content = 'changed';
    expect(joined(encodeJsonBytes(list))).toBe('[{"role":"user","content":"hello"}]');
    const once = encodeOnce({ a: 1 });
    once.a = 2;
    expect(joined(encodeJsonBytes({ once }))).toBe('{"once":{"a":1}}');
  });

  test('a list that shrank is not trusted: it is written as it is now', () => {
    const list: JsonValue[] = [];
    appendEncoded(list, 'a', 'b', 'c');
    list.shift();
    expect(joined(encodeJsonBytes(list))).toBe('["b","c"]');
  });

  test('a value the codec refuses is refused when written, with its JsonEncodeError', () => {
    const list: unknown[] = [];
    appendEncoded(list, { when: new Date(0) });
    expect(() => encodeJsonBytes({ list })).toThrow(JsonEncodeError);
    expect(() => encodeJsonBytes({ x: undefined })).toThrow(JsonEncodeError);
    expect(() => encodeJsonBytes(encodeOnce({ f: () => 1 }))).toThrow(JsonEncodeError);
  });
});
