import type { ControlObserver, OperationEvent, RefusalEvent } from '../../src/control/observer.js';
import { CheckpointStateError } from '../../src/errors.js';
import { createGymApp } from '../../src/server.js';
import { parseStackFile } from '../../src/settings.js';
import { readParticipantState } from '../../src/store.js';
import { MemoryLogger, type TestRecord, TestParticipant } from '../support/test-participant.js';
import {
  commitRequest,
  ep,
  harness,
  prepared,
  restoreRequest,
  until,
  useHarness,
  writeCheckpoint,
} from './harness.js';

useHarness();

/** An observer that keeps what it is told. */
class Recording implements ControlObserver {
  readonly operations: OperationEvent[] = [];
  readonly refusals: RefusalEvent[] = [];
  readonly expiries: { checkpoint_id: string; phase: string }[] = [];

  onOperation(event: OperationEvent): void {
    this.operations.push(event);
  }

  onRefused(event: RefusalEvent): void {
    this.refusals.push(event);
  }

  onLeaseExpired(event: { checkpoint_id: string; phase: string }): void {
    this.expiries.push(event);
  }

  names(operation: string): string[][] {
    return this.operations
      .filter((e) => e.operation === operation)
      .map((e) => e.stages.map((s) => s.name));
  }
}

function observed() {
  const recording = new Recording();
  return { recording, h: harness({ observers: [recording] }) };
}

describe('control observer', () => {
  test('a commit reports its stages in order with its checkpoint id, episodes and bytes', async () => {
    const { recording, h } = observed();
    await prepared(h, 'c1', ['r', 's']);
    const reply = await h.plane.commit(commitRequest(h, 'c1', null));
    const commits = recording.operations.filter((e) => e.operation === 'commit');
    expect(commits).toHaveLength(1);
    expect(commits[0]).toMatchObject({
      checkpoint_id: 'c1',
      outcome: 'ok',
      phase: 'committed',
      episodes: 2,
      bytes: reply.manifest.records_bytes,
    });
    expect(recording.names('commit')).toEqual([['export', 'records_write']]);
    const [commit] = commits;
    for (const stage of commit!.stages) {
      expect(stage.ms).toBeGreaterThanOrEqual(0);
      expect(stage.cpu_ms).toBeGreaterThanOrEqual(0);
    }
    expect(commit!.ms).toBeGreaterThanOrEqual(commit!.stages[0]!.ms);
  });

  test('a scoped commit that stops reports the cleanup and the park after the write', async () => {
    const { recording, h } = observed();
    await prepared(h, 'c1', ['r']);
    await h.plane.commit(commitRequest(h, 'c1', ['r'], { stop: true }));
    expect(recording.names('commit')).toEqual([
      ['export', 'records_write', 'restored_cleanup', 'park'],
    ]);
  });

  test('a replayed commit is not reported again', async () => {
    const { recording, h } = observed();
    await prepared(h, 'c1', ['r']);
    await h.plane.commit(commitRequest(h, 'c1', ['r']));
    await h.plane.commit(commitRequest(h, 'c1', ['r']));
    expect(recording.names('commit')).toHaveLength(1);
  });

  test('a failed commit reports its code and the stages before the failure', async () => {
    const recording = new Recording();
    const h = harness({
      observers: [recording],
      storage: {
        read: readParticipantState,
        write: () => Promise.reject(new CheckpointStateError('disk full')),
      },
    });
    await prepared(h, 'c1', ['r']);
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).rejects.toMatchObject({
      code: 'invalid_checkpoint_state',
    });
    expect(recording.operations.filter((e) => e.operation === 'commit')).toEqual([
      expect.objectContaining({ checkpoint_id: 'c1', outcome: 'invalid_checkpoint_state' }),
    ]);
    expect(recording.names('commit')).toEqual([['export']]);
    expect(recording.refusals).toEqual([
      expect.objectContaining({
        operation: 'commit',
        checkpoint_id: 'c1',
        code: 'invalid_checkpoint_state',
      }),
    ]);
  });

  test('a prepare reports closing admission, then the readiness wait', async () => {
    const { recording, h } = observed();
    await prepared(h, 'c1', ['r']);
    expect(recording.operations).toEqual([
      expect.objectContaining({ operation: 'prepare', checkpoint_id: 'c1', outcome: 'ok' }),
    ]);
    expect(recording.names('prepare')).toEqual([['close_admission', 'readiness_wait']]);
  });

  test('a refused prepare reports its code and no operation', async () => {
    const { recording, h } = observed();
    await prepared(h, 'c1');
    await h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() });
    recording.operations.length = 0;
    await expect(
      h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() }),
    ).rejects.toMatchObject({ code: 'stale_checkpoint' });
    expect(recording.refusals).toEqual([
      expect.objectContaining({
        operation: 'prepare',
        checkpoint_id: 'c1',
        code: 'stale_checkpoint',
      }),
    ]);
    expect(recording.operations).toEqual([]);
  });

  test('a restore reports the read, closing admission and the install, with its source', async () => {
    const { recording, h } = observed();
    await writeCheckpoint(h, 'src', [
      { key: 'r', payload: 1 },
      { key: 's', payload: 2 },
    ]);
    await h.plane.restore(restoreRequest(h, 'c9', 'src', ['r', 's']));
    expect(recording.operations).toEqual([
      expect.objectContaining({
        operation: 'restore',
        checkpoint_id: 'c9',
        source_checkpoint_id: 'src',
        outcome: 'ok',
        phase: 'restored',
        episodes: 2,
      }),
    ]);
    expect(recording.names('restore')).toEqual([['read', 'close_admission', 'install']]);
  });

  test('a retire reports its drain and the attempts it newly retired', async () => {
    const { recording, h } = observed();
    h.participant.start('r');
    await h.plane.retire({ checkpoint_id: 'any', deadline_ts: h.at(), episode_ids: [ep('r')] });
    expect(recording.operations).toEqual([
      expect.objectContaining({
        operation: 'retire',
        checkpoint_id: 'any',
        outcome: 'ok',
        episodes: 1,
      }),
    ]);
    expect(recording.names('retire')).toEqual([['retire_drain']]);
  });

  test('an expired lease is reported with its checkpoint and phase', async () => {
    const { recording, h } = observed();
    await prepared(h, 'c1');
    h.clock.advance(10 + 60);
    await until(() => h.plane.status().phase === 'idle');
    expect(recording.expiries).toEqual([{ checkpoint_id: 'c1', phase: 'prepared' }]);
  });

  test('an observer that throws is logged and does not fail the commit or stop the next one', async () => {
    const recording = new Recording();
    const failing: ControlObserver = {
      onOperation() {
        throw new Error('metrics are down');
      },
    };
    const h = harness({ observers: [failing, recording] });
    await prepared(h, 'c1', ['r']);
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).resolves.toMatchObject({
      phase: 'committed',
    });
    expect(recording.names('commit')).toHaveLength(1);
    expect(h.logger.lines).toContainEqual(
      expect.objectContaining({
        level: 'error',
        message: 'a control observer failed; ignored',
        meta: expect.objectContaining({ hook: 'onOperation', error: 'metrics are down' }),
      }),
    );
    expect(h.logger.lines.map((l) => l.message)).toContain('checkpoint committed');
  });

  test("createGymApp hands the plane's observers on, beside its log lines", async () => {
    const recording = new Recording();
    const logger = new MemoryLogger();
    const stack = parseStackFile(
      [
        'checkpoint: { enabled: true, control_auth_token: t }',
        'servers:',
        '  counter: { kind: resources, app: counter, port: 0 }',
        '',
      ].join('\n'),
    );
    const gym = createGymApp<TestRecord>({
      name: 'counter',
      kind: 'resources',
      checkpoint: stack.checkpoint,
      participant: new TestParticipant('counter', 'resources'),
      logger,
      plane: { observers: [recording] },
    });
    try {
      await gym.plane?.prepare({ checkpoint_id: 'c1', deadline_ts: Date.now() / 1000 + 30 });
      await gym.plane?.resume({ checkpoint_id: 'c1', deadline_ts: Date.now() / 1000 + 30 });
      await expect(
        gym.plane?.prepare({ checkpoint_id: 'c1', deadline_ts: Date.now() / 1000 + 30 }),
      ).rejects.toMatchObject({ code: 'stale_checkpoint' });
    } finally {
      gym.plane?.dispose();
    }
    expect(recording.names('prepare')).toEqual([['close_admission', 'readiness_wait']]);
    expect(recording.refusals).toEqual([
      expect.objectContaining({ operation: 'prepare', code: 'stale_checkpoint' }),
    ]);
  });
});
