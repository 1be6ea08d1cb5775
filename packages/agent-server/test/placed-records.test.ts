/**
 * How a restore reads an agent record undecoded. As the agent writes it (its state last), the
 * coordinator of several workers and each worker (as one process) read it from the fields ahead of
 * its state, decoding the state at first use. Written in another order, the coordinator places a
 * native session by the fields ahead of its state only (its worker checks the record whole) and
 * checks a legacy `/run`'s record whole (it stays on the coordinator until a request claims it).
 */
import {
  DEFER_DECODE_MIN_BYTES,
  newRoutingId,
  type RawRecord,
  readRawParticipantState,
  RECORD_FIELDS_JSON,
  writeParticipantState,
} from '@ckpt-gym/core/server';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { ep } from '@ckpt-gym/testing';

import { AgentParticipant, placedRecordOfRaw } from '../src/participant.js';
import { type Harness, startStack } from './support/harness.js';

let root: string;
beforeEach(async () => {
  root = await mkdtemp(join(tmpdir(), 'cg-placed-'));
});
afterEach(() => rm(root, { recursive: true, force: true }));

/** The records read back raw from a checkpoint whose record of `key` has these fields' text. */
async function readBack(fields: Record<string, string>): Promise<Map<string, RawRecord>> {
  await writeParticipantState({
    checkpointDir: root,
    kind: 'agent',
    instance: 'simple_agent',
    checkpointId: 'c1',
    records: Object.entries(fields).map(([key, text]) => ({
      episode_id: ep(key),
      [RECORD_FIELDS_JSON]: [text],
    })),
  });
  const { records } = await readRawParticipantState<RawRecord>({
    checkpointDir: root,
    kind: 'agent',
    instance: 'simple_agent',
    select: () => true,
    validate: (record) => record,
  });
  return new Map(records.map((r) => [r.episode_id.rollout_id, r]));
}

/** A state whose text is not JSON, not even in its structure: reading it fails. */
const BROKEN_STATE = '"session":{"m": [},"boundary":null,"episode":null';

describe('a restored record as the agent writes it, its state last', () => {
  let h: Harness | undefined;
  afterEach(() => h?.close());

  test('is read from the fields ahead of its state, on the coordinator and on a worker (a record past the size decoded at once); the state is decoded at first read', async () => {
    const owner = newRoutingId();
    const pad = 'x'.repeat(DEFER_DECODE_MIN_BYTES);
    const raw = await readBack({
      r1: `"session_key":"s1","owner":"${owner}","boundary":{"step":2},"episode":null,"session":{"pad":"${pad}","m": [}`,
    });
    h = await startStack();
    const worker = h.agent.participant as AgentParticipant;
    for (const record of [
      placedRecordOfRaw(raw.get('r1')!, 'r1'),
      worker.validateRawRecord(raw.get('r1')!, 'r1'),
    ]) {
      expect([record.session_key, record.owner, record.boundary, record.episode]).toEqual([
        's1',
        owner,
        { step: 2 },
        null,
      ]);
      expect(() => record.session).toThrow(
        expect.objectContaining({ code: 'invalid_checkpoint_state' }),
      );
    }
  });
});

describe('a restored record under the size decoded at once, on a worker or one process', () => {
  let h: Harness | undefined;
  afterEach(() => h?.close());

  test('is decoded whole as it is read: a state that is not JSON fails the read, naming the episode', async () => {
    const raw = await readBack({
      r1: `"session_key":"s1","boundary":{"step":2},"episode":null,"session":{"m": [}`,
    });
    h = await startStack();
    const participant = h.agent.participant as AgentParticipant;
    expect(() => participant.validateRawRecord(raw.get('r1')!, 'r1')).toThrow(
      expect.objectContaining({
        code: 'invalid_checkpoint_state',
        detail: expect.stringContaining('r1'),
      }),
    );
  });
});

describe('a restored record written in another order, on the agent coordinator', () => {
  test('a native session is placed by its key and owner; its state and boundaries are not read until asked', async () => {
    const owner = newRoutingId();
    const raw = await readBack({ r1: `"session_key":"s1","owner":"${owner}",${BROKEN_STATE}` });
    const record = placedRecordOfRaw(raw.get('r1')!, 'r1');
    expect([record.episode_id, record.session_key, record.owner]).toEqual([ep('r1'), 's1', owner]);
    // Asked, the record is checked whole, as the one-process participant checks it.
    expect(() => record.boundary).toThrow(
      expect.objectContaining({ code: 'invalid_checkpoint_state' }),
    );
  });

  test('a legacy /run record, and a record written in another order, are checked whole at once', async () => {
    const raw = await readBack({
      r1: `"session_key":"run:r1",${BROKEN_STATE}`,
      r2: `${BROKEN_STATE},"session_key":"s2"`,
    });
    for (const key of ['r1', 'r2']) {
      expect(() => placedRecordOfRaw(raw.get(key)!, key)).toThrow(
        expect.objectContaining({ code: 'invalid_checkpoint_state' }),
      );
    }
  });

  test('an owner that is not a routing id is refused with a typed error naming the episode', async () => {
    const raw = await readBack({ r1: `"session_key":"s1","owner":"../x",${BROKEN_STATE}` });
    expect(() => placedRecordOfRaw(raw.get('r1')!, 'r1')).toThrow(
      expect.objectContaining({
        code: 'invalid_checkpoint_state',
        detail: expect.stringContaining('r1'),
      }),
    );
  });
});
