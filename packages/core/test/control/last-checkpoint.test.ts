import { withOperation } from '../../src/control/last-checkpoint.js';
import type { OperationEvent } from '../../src/control/observer.js';
import { CheckpointStateError } from '../../src/errors.js';
import {
  commitRequest,
  harness,
  prepared,
  restoreRequest,
  useHarness,
  writeCheckpoint,
} from './harness.js';

useHarness();

function event(overrides: Partial<OperationEvent>): OperationEvent {
  return {
    operation: 'prepare',
    checkpoint_id: 'c1',
    started_at: 0,
    outcome: 'ok',
    phase: 'prepared',
    stages: [{ name: 'readiness_wait', ms: 5, cpu_ms: 1 }],
    ms: 6,
    cpu_ms: 2,
    episodes: 0,
    ...overrides,
  };
}

describe('withOperation', () => {
  test('adds an operation of the same checkpoint beside the earlier ones', () => {
    const prepare = withOperation(null, event({}), 100);
    const both = withOperation(prepare, event({ operation: 'commit', episodes: 3, bytes: 9 }), 101);
    expect(both).toEqual({
      checkpoint_id: 'c1',
      operations: {
        prepare: {
          outcome: 'ok',
          ended_at: 100,
          ms: 6,
          cpu_ms: 2,
          stages: [{ name: 'readiness_wait', ms: 5, cpu_ms: 1 }],
          episodes: 0,
        },
        commit: expect.objectContaining({ ended_at: 101, episodes: 3, bytes: 9 }),
      },
    });
  });

  test('a new checkpoint id starts afresh and a repeated operation replaces the first', () => {
    const first = withOperation(null, event({ operation: 'commit' }), 100);
    const next = withOperation(first, event({ checkpoint_id: 'c2', ms: 7 }), 101);
    expect(next).toEqual({
      checkpoint_id: 'c2',
      operations: { prepare: expect.objectContaining({ ms: 7 }) },
    });
    const again = withOperation(next, event({ checkpoint_id: 'c2', ms: 8 }), 102);
    expect(again.operations).toEqual({
      prepare: expect.objectContaining({ ms: 8, ended_at: 102 }),
    });
  });
});

describe("the status reply's last_checkpoint", () => {
  test('is null before the first operation', () => {
    expect(harness().plane.status().last_checkpoint).toBeNull();
  });

  test("holds the checkpoint's prepare and commit with their stages, episodes and bytes", async () => {
    const h = harness();
    await prepared(h, 'c1', ['r', 's']);
    const reply = await h.plane.commit(commitRequest(h, 'c1', null));
    const last = h.plane.status().last_checkpoint;
    expect(last?.checkpoint_id).toBe('c1');
    expect(Object.keys(last?.operations ?? {})).toEqual(['prepare', 'commit']);
    const { prepare, commit } = last!.operations;
    expect(prepare?.stages.map((s) => s.name)).toEqual(['close_admission', 'readiness_wait']);
    expect(commit).toMatchObject({
      outcome: 'ok',
      ended_at: h.clock.now(),
      episodes: 2,
      bytes: reply.manifest.records_bytes,
    });
    expect(commit?.stages.map((s) => s.name)).toEqual(['export', 'records_write']);
  });

  test('a failed commit is kept with its code', async () => {
    const h = harness();
    h.participant.exportError = new CheckpointStateError('cannot export');
    await prepared(h, 'c1', ['r']);
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).rejects.toMatchObject({
      code: 'export_failed',
    });
    expect(h.plane.status().last_checkpoint?.operations.commit?.outcome).toBe('export_failed');
  });

  test('a restore under a new id replaces the committed checkpoint', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    await h.plane.commit(commitRequest(h, 'c1', ['r']));
    await h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() });
    await writeCheckpoint(h, 'src', [{ key: 'r', payload: 1 }]);
    await h.plane.restore(restoreRequest(h, 'c9', 'src', ['r']));
    const last = h.plane.status().last_checkpoint;
    expect(last?.checkpoint_id).toBe('c9');
    expect(Object.keys(last?.operations ?? {})).toEqual(['restore']);
    expect(last?.operations.restore?.stages.map((s) => s.name)).toEqual([
      'read',
      'close_admission',
      'install',
    ]);
  });
});
