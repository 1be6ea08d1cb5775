/**
 * Records as bytes between workers and their coordinator. Export: each record's JSON after
 * `episode_id` is what the store writes for it in one process, and the coordinator's records are
 * views of those bytes. Install: each record's line as the store read it, or as it writes it.
 */
import { mkdtemp, readdir, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { episodeId } from '../../src/identity.js';
import { appendEncoded, encodeOnce } from '../../src/json-pieces.js';
import {
  type CheckpointRecord,
  RECORD_FIELDS_JSON,
  writeParticipantState,
} from '../../src/store.js';
import {
  handedLines,
  handedRecords,
  handLines,
  handRecords,
} from '../../src/workers/handed-records.js';

let root: string;
beforeEach(async () => {
  root = await mkdtemp(join(tmpdir(), 'cg-handed-'));
});
afterEach(() => rm(root, { recursive: true, force: true }));

/** The records file the store writes for `records`. */
async function written(records: CheckpointRecord[], name: string): Promise<Buffer> {
  const checkpointDir = join(root, name);
  await writeParticipantState({
    checkpointDir,
    kind: 'agent',
    instance: 'a',
    checkpointId: 'c',
    records,
  });
  const dir = join(checkpointDir, 'gym', 'agent', 'a');
  const file = (await readdir(dir)).find((f) => f.startsWith('records-'))!;
  return readFile(join(dir, file));
}

function sampleRecords(): CheckpointRecord[] {
  const messages: unknown[] = [];
  appendEncoded(messages, { role: 'user', content: 'é' }, { logprob: -Infinity });
  return [
    {
      episode_id: episodeId('r1', 0),
      session_key: 's1',
      owner: 'w1',
      state: { score: NaN, tokens: [2n ** 64n, 2 ** 53], messages },
      kept: encodeOnce({ big: -(2n ** 70n) }),
    },
    // Pieces a participant encoded ahead, text and bytes.
    {
      episode_id: episodeId('r2', 3),
      session_key: 's2',
      [RECORD_FIELDS_JSON]: ['"session_key":"s2","state":', Buffer.from('{"x":Infinity}')],
    },
    // Nothing after its episode.
    { episode_id: episodeId('r3', 0) },
  ];
}

describe("a worker's handed records", () => {
  test("written by the coordinator's store, they are byte for byte what one process writes", async () => {
    const records = sampleRecords();
    const { index, bytes } = handRecords(records, ['session_key', 'owner']);
    expect(index.map((r) => r.head)).toEqual([
      { episode_id: { rollout_id: 'r1', attempt: 0 }, session_key: 's1', owner: 'w1' },
      { episode_id: { rollout_id: 'r2', attempt: 3 }, session_key: 's2' },
      { episode_id: { rollout_id: 'r3', attempt: 0 } },
    ]);
    const coordinated = handedRecords(index, bytes);
    expect(coordinated[2]![RECORD_FIELDS_JSON]).toEqual([]);
    const fromWorkers = await written(coordinated, 'workers');
    expect(fromWorkers.toString()).toContain(
      '"state":{"score":NaN,"tokens":[18446744073709551616,9007199254740992.0],"messages":[{"role":"user","content":"é"},{"logprob":-Infinity}]}',
    );
    expect(fromWorkers.equals(await written(records, 'one-process'))).toBe(true);
  });

  test('a record the codec refuses fails the export with a typed error naming its episode', () => {
    const records = [{ episode_id: episodeId('r1', 0), when: new Date(0) }];
    expect(() => handRecords(records, [])).toThrow(/record of episode 'r1' is not JSON/);
  });

  test('an index that does not cover its bytes exactly fails the export', () => {
    const { index, bytes } = handRecords(sampleRecords(), []);
    expect(() => handedRecords(index, bytes.subarray(1))).toThrow(/do not match their bytes/);
    expect(() => handedRecords(index.slice(1), bytes)).toThrow(/do not match their bytes/);
  });
});

describe("a coordinator's handed lines", () => {
  test('a line the store read is handed as it is; a record known only decoded as the line the store writes', async () => {
    const records = sampleRecords();
    const fileLines = (await written(records, 'file')).toString().trimEnd().split('\n');
    const asRead = Buffer.from(`${fileLines[0]!} `); // not what encoding would give: handed as read
    const { index, bytes } = handLines(records, (r) => (r === records[0] ? asRead : undefined));
    const lines = handedLines(index, bytes);
    // Each line is its own copy: a session kept undecoded does not hold the whole message.
    bytes.fill(0);
    expect(lines.map((l) => l.episode)).toEqual(records.map((r) => r.episode_id));
    expect(lines.map((l) => l.line.toString())).toEqual([
      asRead.toString(),
      fileLines[1],
      fileLines[2],
    ]);
  });

  test('an index that does not cover its bytes exactly fails the install', () => {
    const { index, bytes } = handLines(sampleRecords(), () => undefined);
    expect(() => handedLines(index, bytes.subarray(1))).toThrow(/do not match their bytes/);
    expect(() => handedLines(index.slice(1), bytes)).toThrow(/do not match their bytes/);
  });
});
