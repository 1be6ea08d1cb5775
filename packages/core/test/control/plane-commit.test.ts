import { existsSync } from 'node:fs';
import { readFile } from 'node:fs/promises';

import { CONTROL_CONCURRENCY } from '../../src/control/plane.js';
import { CheckpointStateError } from '../../src/errors.js';
import {
  readParticipantState,
  type WriteParticipantStateOptions,
  writeParticipantState,
} from '../../src/store.js';
import { Gate } from '../support/test-participant.js';
import {
  commitRequest,
  ep,
  eps,
  harness,
  hasManifest,
  manifestPath,
  prepared,
  readRecords,
  settle,
  track,
  until,
  useHarness,
} from './harness.js';

useHarness();

/** A store whose writes wait for `gate` (when set) and can be made to fail, counting calls. */
function gatedStorage() {
  const storage = {
    writes: [] as WriteParticipantStateOptions[],
    gate: null as Gate | null,
    failNext: 0,
    write: async (opts: WriteParticipantStateOptions) => {
      storage.writes.push(opts);
      if (storage.gate) await storage.gate.promise;
      if (storage.failNext > 0) {
        storage.failNext -= 1;
        throw new CheckpointStateError('cannot write checkpoint state: disk full');
      }
      return writeParticipantState(opts);
    },
  };
  return storage;
}

describe('commit', () => {
  test('commit writes records then the manifest and replies the exported capture keys sorted and unique', async () => {
    const h = harness();
    h.participant.commitExtra = { staging_keys: ['k1'] };
    await prepared(h, 'c1', ['s', 'r-a2', 'q']);
    const reply = await h.plane.commit(commitRequest(h, 'c1', ['s', 'r-a2']));
    expect(reply.phase).toBe('committed');
    expect(reply.episode_ids).toEqual(['r-a2', 's']);
    expect(reply.staging_keys).toEqual(['k1']);
    expect(reply.manifest).toMatchObject({
      checkpoint_id: 'c1',
      record_count: 2,
      kind: 'environment',
    });
    expect(JSON.parse(await readFile(manifestPath(h, 'c1'), 'utf8'))).toEqual(reply.manifest);
    expect(h.plane.status().phase).toBe('committed');
    // Admission stays closed until resume.
    expect(h.participant.admissionOpen).toBe(false);
  });

  test('a commit logs where its time and its CPU went: export, write, total', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    await h.plane.commit(commitRequest(h, 'c1', ['r']));
    const line = h.logger.lines.find((l) => l.message === 'checkpoint committed');
    expect(line?.meta).toMatchObject({ checkpoint_id: 'c1', records: 1 });
    for (const field of ['export_ms', 'write_ms', 'total_ms', 'export_cpu_ms', 'write_cpu_ms']) {
      expect(line?.meta[field]).toEqual(expect.any(Number));
      expect(line?.meta[field]).toBeGreaterThanOrEqual(0);
    }
  });

  test('export_ms covers an export that does all its work before its first await', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    const exportRecords = h.participant.export.bind(h.participant);
    h.participant.export = (scope, signal) => {
      // Synchronous work, as an export of thousands of in-memory episodes does.
      const until = performance.now() + 30;
      while (performance.now() < until);
      return exportRecords(scope, signal);
    };
    await h.plane.commit(commitRequest(h, 'c1', ['r']));
    const line = h.logger.lines.find((l) => l.message === 'checkpoint committed');
    expect(line?.meta.export_ms).toBeGreaterThanOrEqual(30);
  });

  test("a participant's extra reply key cannot replace a base key", async () => {
    const h = harness();
    h.participant.commitExtra = { manifest: 'mine' };
    await prepared(h, 'c1', ['r']);
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).rejects.toMatchObject({
      code: 'checkpoint_error',
    });
  });

  test('commit is refused outside the prepared phase', async () => {
    const h = harness();
    h.participant.start('r');
    const prepare = track(h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at(1) }));
    await settle();
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).rejects.toMatchObject({
      code: 'invalid_phase',
    });
    h.clock.advance(1);
    await prepare.promise;
  });

  test('a commit whose scope names a current restart is refused with restart_in_scope', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    h.participant.start('x', 'restart');
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r', 'x']))).rejects.toMatchObject({
      code: 'restart_in_scope',
      message: expect.stringContaining('x'),
    });
    // Not final: the controller may leave the restart out.
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).resolves.toMatchObject({
      episode_ids: ['r'],
    });
  });

  test('a commit whose scope names a carried restart is refused with restart_in_scope', async () => {
    const h = harness();
    h.participant.start('r', 'parked');
    h.participant.start('y'); // running here, but a restart on an earlier stage
    await h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at(), restarts: ['y'] });
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r', 'y']))).rejects.toMatchObject({
      code: 'restart_in_scope',
    });
  });

  test('a commit refused because readiness regressed is final for its checkpoint', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    h.participant.setState('r', 'running');
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).rejects.toMatchObject({
      code: 'export_failed',
    });
    h.participant.setState('r', 'parked');
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).rejects.toMatchObject({
      code: 'export_failed',
    });
    expect(h.participant.calls.export).toBe(0);
    await h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() });
    await prepared(h, 'c2');
    await expect(h.plane.commit(commitRequest(h, 'c2', ['r']))).resolves.toMatchObject({
      episode_ids: ['r'],
    });
  });

  test('a failed export is final for its checkpoint and a new checkpoint commits the new state', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    h.participant.exportError = new Error('boundary not serialisable');
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).rejects.toMatchObject({
      code: 'export_failed',
      message: expect.stringContaining('boundary not serialisable'),
    });
    h.participant.exportError = null;
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).rejects.toMatchObject({
      code: 'export_failed',
    });
    expect(h.participant.calls.export).toBe(1);

    await h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() });
    const live = h.participant.episodes.get('r');
    if (live) live.payload = { step: 7 };
    await prepared(h, 'c2');
    await h.plane.commit(commitRequest(h, 'c2', ['r']));
    expect(await readRecords(h, 'c2')).toEqual([
      { episode_id: { rollout_id: 'r', attempt: 0 }, payload: { step: 7 } },
    ]);
  });

  test('after a failed export, a commit with another scope gets export_failed too', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r', 's']);
    h.participant.exportError = new Error('boom');
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).rejects.toMatchObject({
      code: 'export_failed',
    });
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r', 's']))).rejects.toMatchObject({
      code: 'export_failed',
    });
  });

  test('a failed export is final also when the export outlived its commit', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    h.participant.exportGate = new Gate();
    const commit = track(h.plane.commit(commitRequest(h, 'c1', ['r'], { deadline_ts: h.at(2) })));
    await settle();
    h.clock.advance(2);
    await settle();
    expect(commit.error).toMatchObject({ code: 'deadline_exceeded' });
    h.participant.exportGate.fail(new Error('export crashed late'));
    await settle();
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).rejects.toMatchObject({
      code: 'export_failed',
      message: expect.stringContaining('export crashed late'),
    });
    expect(h.participant.calls.export).toBe(1);
  });

  test('a commit retried after its export finished reuses that export', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    h.participant.exportGate = new Gate();
    const first = track(h.plane.commit(commitRequest(h, 'c1', ['r'], { deadline_ts: h.at(2) })));
    await settle();
    h.clock.advance(2);
    await settle();
    expect(first.error).toMatchObject({ code: 'deadline_exceeded' });
    h.participant.exportGate.open();
    await settle();
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).resolves.toMatchObject({
      episode_ids: ['r'],
    });
    expect(h.participant.calls.export).toBe(1);
  });

  test('a commit retried while its write runs awaits that write', async () => {
    const storage = gatedStorage();
    const h = harness({ storage: { write: storage.write, read: readParticipantState } });
    await prepared(h, 'c1', ['r']);
    storage.gate = new Gate();
    const first = track(h.plane.commit(commitRequest(h, 'c1', ['r'], { deadline_ts: h.at(2) })));
    await until(() => storage.writes.length === 1);
    h.clock.advance(2);
    await settle();
    expect(first.error).toMatchObject({ code: 'deadline_exceeded' });
    const retry = track(h.plane.commit(commitRequest(h, 'c1', ['r'])));
    await settle();
    expect(retry.settled).toBe(false);
    storage.gate.open();
    await until(() => retry.settled);
    expect(retry.value?.phase).toBe('committed');
    expect(storage.writes).toHaveLength(1);
  });

  test('a commit retried while its write runs with another scope conflicts', async () => {
    const storage = gatedStorage();
    const h = harness({ storage: { write: storage.write, read: readParticipantState } });
    await prepared(h, 'c1', ['r', 's']);
    storage.gate = new Gate();
    const first = track(h.plane.commit(commitRequest(h, 'c1', ['r'], { deadline_ts: h.at(2) })));
    await until(() => storage.writes.length === 1);
    h.clock.advance(2);
    await settle();
    expect(first.error).toMatchObject({ code: 'deadline_exceeded' });
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r', 's']))).rejects.toMatchObject({
      code: 'checkpoint_conflict',
      message: expect.stringContaining('already being written'),
    });
    storage.gate.open();
    // The write outlived its commit: let it finish before the test's directory is removed.
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).resolves.toMatchObject({
      phase: 'committed',
    });
  });

  test('a commit retried after its write failed stores the same records', async () => {
    const storage = gatedStorage();
    const h = harness({ storage: { write: storage.write, read: readParticipantState } });
    await prepared(h, 'c1', ['r']);
    storage.failNext = 1;
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).rejects.toMatchObject({
      code: 'invalid_checkpoint_state',
    });
    expect(h.plane.status().phase).toBe('prepared');
    const live = h.participant.episodes.get('r');
    if (live) live.payload = { changed: true }; // must not reach the checkpoint
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).resolves.toMatchObject({
      episode_ids: ['r'],
    });
    expect(storage.writes).toHaveLength(2);
    expect(storage.writes[1]?.records).toBe(storage.writes[0]?.records);
    expect(h.participant.calls.export).toBe(1);
  });

  test('a completed commit retried with another scope conflicts, with the same scope in another order replays', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r', 's', 't']);
    const first = await h.plane.commit(commitRequest(h, 'c1', ['r', 's']));
    await expect(h.plane.commit(commitRequest(h, 'c1', ['s', 'r']))).resolves.toBe(first);
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r', 's', 't']))).rejects.toMatchObject({
      code: 'checkpoint_conflict',
      message: expect.stringContaining('another directory or scope'),
    });
    await expect(
      h.plane.commit(commitRequest(h, 'c1', ['r', 's'], { checkpoint_dir: h.dir('elsewhere') })),
    ).rejects.toMatchObject({
      code: 'checkpoint_conflict',
    });
    await expect(h.plane.commit(commitRequest(h, 'c1', null))).rejects.toMatchObject({
      code: 'checkpoint_conflict',
    });
  });

  test('a null scope exports everything and deletes no restored state', async () => {
    const h = harness();
    h.participant.restored.set('u-a1', { episode: ep('u-a1'), payload: 1 });
    await prepared(h, 'c1', ['r']);
    const reply = await h.plane.commit(commitRequest(h, 'c1', null));
    expect(reply.episode_ids).toEqual(['r', 'u-a1']);
    expect(h.participant.calls.deleteRestored).toEqual([]);
  });

  test('an export naming episodes outside the scope fails the checkpoint', async () => {
    const h = harness();
    h.participant.exportOutside = eps('zz');
    await prepared(h, 'c1', ['r']);
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).rejects.toMatchObject({
      code: 'export_failed',
      message: expect.stringContaining('zz'),
    });
    expect(hasManifest(h, 'c1')).toBe(false);
  });

  test('commit with stop parks the exported state after the durable write; a park failure is logged and ignored', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    let manifestAtPark: boolean | undefined;
    h.participant.parkExported = async () => {
      manifestAtPark = hasManifest(h, 'c1');
      throw new Error('sandbox would not pause');
    };
    const reply = await h.plane.commit(commitRequest(h, 'c1', ['r'], { stop: true }));
    expect(reply.phase).toBe('committed');
    expect(manifestAtPark).toBe(true);
    expect(
      h.logger.lines.some((l) => l.level === 'warn' && String(l.meta.error).includes('sandbox')),
    ).toBe(true);
  });

  test('commit without stop does not park', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    await h.plane.commit(commitRequest(h, 'c1', ['r']));
    expect(h.participant.calls.parkExported).toBe(0);
  });
});

describe('unscoped restored state', () => {
  function withRestored(h: ReturnType<typeof harness>, keys: string[]): void {
    for (const [i, e] of eps(...keys).entries())
      h.participant.restored.set(keys[i] as string, { episode: e, payload: i });
  }

  test('a commit deletes restored episodes its scope leaves out, without retiring them, concurrently', async () => {
    const h = harness();
    const unscoped = Array.from({ length: 10 }, (_, i) => `u${i}-a1`);
    withRestored(h, ['kept-a1', ...unscoped]);
    await prepared(h, 'c1', ['r']);
    h.participant.deleteGate = new Gate();
    const commit = track(h.plane.commit(commitRequest(h, 'c1', ['r', 'kept-a1'])));
    await until(() => h.participant.calls.deleteRestored.length === unscoped.length);
    expect(h.participant.maxDeletesInFlight).toBe(unscoped.length);
    h.participant.deleteGate.open();
    await commit.promise;
    expect(commit.value?.episode_ids).toEqual(['kept-a1', 'r']);
    expect([...h.participant.calls.deleteRestored].sort()).toEqual([...unscoped].sort());
    expect(h.participant.calls.retire).toEqual([]);
    expect(h.participant.marks.size).toBe(0);
    expect([...h.participant.restored.keys()]).toEqual(['kept-a1']);
  });

  test('deleting unscoped restored state runs a bounded number at a time', async () => {
    const h = harness();
    withRestored(
      h,
      Array.from({ length: CONTROL_CONCURRENCY + 20 }, (_, i) => `u${i}-a1`),
    );
    await prepared(h, 'c1');
    h.participant.deleteGate = new Gate();
    const commit = track(h.plane.commit(commitRequest(h, 'c1', [])));
    await until(() => h.participant.calls.deleteRestored.length === CONTROL_CONCURRENCY);
    await settle();
    expect(h.participant.calls.deleteRestored).toHaveLength(CONTROL_CONCURRENCY);
    h.participant.deleteGate.open();
    await commit.promise;
    expect(h.participant.restored.size).toBe(0);
  });

  test('a commit that failed while deleting unscoped restored state can be retried and returns the same manifest', async () => {
    const storage = gatedStorage();
    const h = harness({ storage: { write: storage.write, read: readParticipantState } });
    withRestored(h, ['u-a1', 'v-a1']);
    await prepared(h, 'c1', ['r']);
    h.participant.deleteFailures = 1;
    await expect(h.plane.commit(commitRequest(h, 'c1', ['r']))).rejects.toMatchObject({
      code: 'checkpoint_error',
    });
    expect(hasManifest(h, 'c1')).toBe(true);
    const reply = await h.plane.commit(commitRequest(h, 'c1', ['r']));
    expect(reply.manifest).toEqual(JSON.parse(await readFile(manifestPath(h, 'c1'), 'utf8')));
    expect(storage.writes).toHaveLength(1);
    expect(h.participant.restored.size).toBe(0);
  });
});

describe('write and resume', () => {
  test('resume stops a write that outlived its commit before it publishes', async () => {
    const storage = gatedStorage();
    const h = harness({ storage: { write: storage.write, read: readParticipantState } });
    await prepared(h, 'c1', ['r']);
    storage.gate = new Gate();
    const commit = track(h.plane.commit(commitRequest(h, 'c1', ['r'], { deadline_ts: h.at(2) })));
    await until(() => storage.writes.length === 1);
    h.clock.advance(2);
    await settle();
    expect(commit.error).toMatchObject({ code: 'deadline_exceeded' });
    await h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() });
    storage.gate.open();
    // The write runs on and fails at its stop check; give its I/O time to finish.
    await new Promise((resolve) => setTimeout(resolve, 50));
    expect(hasManifest(h, 'c1')).toBe(false);
  });

  test('resume waits for a publication under way, so none appears after it', async () => {
    const publishing = new Gate();
    let publishStarted = false;
    const h = harness({
      storage: {
        read: readParticipantState,
        // Holds the publish lock, as a writer renaming its records and linking its manifest does.
        write: (opts) =>
          (opts.stop as NonNullable<typeof opts.stop>).locked(async () => {
            publishStarted = true;
            await publishing.promise;
            return writeParticipantState({ ...opts, stop: undefined });
          }),
      },
    });
    await prepared(h, 'c1', ['r']);
    const commit = track(h.plane.commit(commitRequest(h, 'c1', ['r'], { deadline_ts: h.at(2) })));
    await until(() => publishStarted);
    h.clock.advance(2);
    await settle();
    expect(commit.error).toMatchObject({ code: 'deadline_exceeded' });
    const resume = track(h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() }));
    await settle();
    expect(resume.settled).toBe(false);
    publishing.open();
    await resume.promise;
    // Whatever was published, was published before resume returned.
    const atReturn = hasManifest(h, 'c1');
    await new Promise((resolve) => setTimeout(resolve, 30));
    expect(hasManifest(h, 'c1')).toBe(atReturn);
    expect(atReturn).toBe(true);
  });

  test('resume cancels a running export', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    h.participant.exportGate = new Gate();
    const commit = track(h.plane.commit(commitRequest(h, 'c1', ['r'], { deadline_ts: h.at(2) })));
    await settle();
    h.clock.advance(2);
    await settle();
    expect(commit.error).toMatchObject({ code: 'deadline_exceeded' });
    expect(h.participant.lastExportSignal?.aborted).toBe(false);
    await h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() });
    expect(h.participant.lastExportSignal?.aborted).toBe(true);
    expect(existsSync(h.dir('c1'))).toBe(false);
  });
});
