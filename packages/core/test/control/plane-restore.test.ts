import { CheckpointError } from '../../src/errors.js';
import { readParticipantState, writeParticipantState } from '../../src/store.js';
import { Gate } from '../support/test-participant.js';
import {
  ep,
  eps,
  harness,
  restoreRequest,
  settle,
  track,
  until,
  useHarness,
  writeCheckpoint,
} from './harness.js';

useHarness();

async function withCheckpoint(h: ReturnType<typeof harness>): Promise<void> {
  await writeCheckpoint(h, 'src', [
    { key: 'r', payload: { step: 3 } },
    { key: 's-a2', payload: { step: 1 } },
    { key: 't', payload: { step: 9 } },
  ]);
}

describe('restore', () => {
  test('restore installs the records in scope under their next attempt and replies them sorted', async () => {
    const h = harness();
    await withCheckpoint(h);
    const reply = await h.plane.restore(restoreRequest(h, 'c9', 'src', ['s-a2', 'r']));
    expect(reply).toEqual({
      phase: 'restored',
      source_checkpoint_id: 'src',
      restored: ['r-a1', 's-a3'],
    });
    expect([...h.participant.restored.keys()].sort()).toEqual(['r-a1', 's-a3']);
    expect(h.plane.status()).toMatchObject({
      phase: 'restored',
      checkpoint_id: 'c9',
      lease_expires_at: h.at() + 60,
    });
    expect(h.participant.admissionOpen).toBe(false);
  });

  test('a restore logs where its time and its CPU went: read and install', async () => {
    const h = harness();
    await withCheckpoint(h);
    await h.plane.restore(restoreRequest(h, 'c9', 'src', ['r']));
    const line = h.logger.lines.find((l) => l.message === 'checkpoint restored');
    expect(line?.meta).toMatchObject({ checkpoint_id: 'c9', source_checkpoint_id: 'src' });
    for (const field of ['read_ms', 'install_ms', 'read_cpu_ms', 'install_cpu_ms']) {
      expect(line?.meta[field]).toEqual(expect.any(Number));
      expect(line?.meta[field]).toBeGreaterThanOrEqual(0);
    }
  });

  test('restore validates only the records in scope', async () => {
    const h = harness();
    await withCheckpoint(h);
    await h.plane.restore(restoreRequest(h, 'c9', 'src', ['t']));
    expect(h.participant.calls.validate).toEqual(['t']);
  });

  test('install is given every episode the restore continues', async () => {
    const h = harness();
    await withCheckpoint(h);
    await h.plane.restore(restoreRequest(h, 'c9', 'src', ['r', 'norecord']));
    expect(h.participant.calls.installScopes).toEqual([['r', 'norecord']]);
  });

  test('a restored record that fails validation is a typed error naming its episode', async () => {
    const h = harness();
    await writeCheckpoint(h, 'bad', [{ key: 'r', payload: 1 }, { key: 'broken-a4' }]);
    await expect(
      h.plane.restore(restoreRequest(h, 'c9', 'bad', ['r', 'broken-a4'])),
    ).rejects.toMatchObject({
      code: 'invalid_checkpoint_state',
      message: expect.stringContaining("'broken-a4'"),
    });
    expect(h.participant.calls.install).toBe(0);
    expect(h.participant.admissionOpen).toBe(true);
    expect(h.plane.status().phase).toBe('idle');
  });

  test('a refused (422) restore raises no retire marks; the untampered checkpoint restores after it', async () => {
    const h = harness();
    await writeCheckpoint(h, 'bad', [{ key: 'r', payload: 1 }, { key: 'broken' }]);
    await withCheckpoint(h);
    for (const dir of ['bad', 'nothing-here']) {
      await expect(
        h.plane.restore(restoreRequest(h, 'c9', dir, ['r', 'broken'])),
      ).rejects.toMatchObject({ code: 'invalid_checkpoint_state' });
      expect(h.participant.marks.size).toBe(0);
      expect(h.plane.status()).toMatchObject({ phase: 'idle', retired_rollouts: 0 });
      expect(h.participant.restored.size).toBe(0);
    }
    const reply = await h.plane.restore(restoreRequest(h, 'c9', 'src', ['r']));
    expect(reply.restored).toEqual(['r-a1']);
    expect(h.participant.marks.isRetired(ep('r'))).toBe(true);
  });

  test('a read that stalls (a hung mount) is abandoned at the deadline; the next restore reads and installs', async () => {
    // The first read never answers, as on a network mount that hangs; the next reads the store.
    let reads = 0;
    const h = harness({
      storage: {
        write: writeParticipantState,
        read: (opts) => (++reads === 1 ? new Promise(() => {}) : readParticipantState(opts)),
      },
    });
    await withCheckpoint(h);
    const stalled = track(
      h.plane.restore({ ...restoreRequest(h, 'c9', 'src', ['r']), deadline_ts: h.at(5) }),
    );
    await settle();
    expect(stalled.settled).toBe(false);
    h.clock.advance(6);
    await until(() => stalled.settled);
    expect(stalled.error).toMatchObject({ code: 'deadline_exceeded' });
    expect(h.plane.status()).toMatchObject({ phase: 'idle', checkpoint_id: null });
    expect(h.participant.calls.install).toBe(0);
    const reply = await h.plane.restore(restoreRequest(h, 'c10', 'src', ['r']));
    expect(reply.restored).toEqual(['r-a1']);
  });

  test('a missing checkpoint is a typed error', async () => {
    const h = harness();
    await expect(
      h.plane.restore(restoreRequest(h, 'c9', 'nothing-here', ['r'])),
    ).rejects.toMatchObject({
      code: 'invalid_checkpoint_state',
    });
  });

  test('a restore refuses the attempts it replaces until forgotten, also past its deadline', async () => {
    const h = harness();
    await withCheckpoint(h);
    const late = { ...restoreRequest(h, 'c9', 'src', ['r', 's-a2']), deadline_ts: h.at(-1) };
    await expect(h.plane.restore(late)).rejects.toMatchObject({ code: 'deadline_exceeded' });
    expect(h.participant.marks.isRetired(ep('r'))).toBe(true);
    expect(h.participant.marks.isRetired(ep('s-a2'))).toBe(true);
    expect(h.participant.marks.isRetired(ep('r-a1'))).toBe(false);
    await h.plane.forget({ checkpoint_id: 'c9', deadline_ts: h.at(), rollout_ids: ['r', 's'] });
    expect(h.participant.marks.isRetired(ep('r'))).toBe(false);
  });

  test('a restore the participant refuses changes nothing', async () => {
    const h = harness();
    await withCheckpoint(h);
    h.participant.restoreRefusal = new CheckpointError('this model server has served calls');
    await expect(h.plane.restore(restoreRequest(h, 'c9', 'src', ['r']))).rejects.toMatchObject({
      code: 'checkpoint_error',
      message: 'this model server has served calls',
    });
    expect(h.participant.marks.size).toBe(0);
    expect(h.participant.calls.closeAdmission).toBe(0);
  });

  test('a restore whose close fails part way reopens admission', async () => {
    const h = harness();
    await withCheckpoint(h);
    h.participant.closeAdmissionError = new Error('worker 3 did not close');
    await expect(h.plane.restore(restoreRequest(h, 'c9', 'src', ['r']))).rejects.toMatchObject({
      code: 'checkpoint_error',
    });
    expect(h.participant.admissionOpen).toBe(true);
    expect(h.plane.status().phase).toBe('idle');
  });

  test('a failed install reopens admission and leaves the phase idle', async () => {
    const h = harness();
    await withCheckpoint(h);
    h.participant.installError = new Error('ledger refused the import');
    await expect(h.plane.restore(restoreRequest(h, 'c9', 'src', ['r']))).rejects.toMatchObject({
      code: 'checkpoint_error',
      message: expect.stringContaining('ledger refused'),
    });
    expect(h.participant.admissionOpen).toBe(true);
    expect(h.plane.status()).toMatchObject({ phase: 'idle', checkpoint_id: null });
    // The id is not fenced: a retry may run.
    h.participant.installError = null;
    await expect(h.plane.restore(restoreRequest(h, 'c9', 'src', ['r']))).resolves.toMatchObject({
      phase: 'restored',
    });
  });

  test('resume retries a reopen that a failed restore could not finish', async () => {
    const h = harness();
    await withCheckpoint(h);
    h.participant.installError = new Error('install failed');
    h.participant.openAdmissionFailures = 1;
    await expect(h.plane.restore(restoreRequest(h, 'c9', 'src', ['r']))).rejects.toMatchObject({
      code: 'checkpoint_error',
    });
    expect(h.participant.admissionOpen).toBe(false);
    await expect(h.plane.resume({ checkpoint_id: 'c9', deadline_ts: h.at() })).resolves.toEqual({
      phase: 'idle',
      idempotent: false,
    });
    expect(h.participant.admissionOpen).toBe(true);
  });

  test('a restore that ran out of time has its install awaited by the next retire and reopens admission only once it finished', async () => {
    const h = harness();
    await withCheckpoint(h);
    h.participant.installGate = new Gate();
    const restore = track(
      h.plane.restore({ ...restoreRequest(h, 'c9', 'src', ['r']), deadline_ts: h.at(2) }),
    );
    await until(() => h.participant.calls.install === 1);
    h.clock.advance(2);
    await settle();
    expect(restore.error).toMatchObject({ code: 'deadline_exceeded' });
    expect(h.participant.admissionOpen).toBe(false);

    const retire = track(
      h.plane.retire({ checkpoint_id: 'c9', deadline_ts: h.at(), episode_ids: eps('r-a1') }),
    );
    await settle();
    expect(retire.settled).toBe(false);
    expect(h.participant.calls.retire).toEqual([]);
    expect(h.participant.admissionOpen).toBe(false);

    h.participant.installGate.open();
    await until(() => retire.settled);
    expect(retire.value).toEqual({ retired_count: 1 });
    expect(h.participant.restored.size).toBe(0); // freed what the install installed
    await until(() => h.participant.admissionOpen);
    expect(h.plane.status().phase).toBe('idle');
  });

  test('resume waits for an install that outlived its restore, then reopens', async () => {
    const h = harness();
    await withCheckpoint(h);
    h.participant.installGate = new Gate();
    const restore = track(
      h.plane.restore({ ...restoreRequest(h, 'c9', 'src', ['r']), deadline_ts: h.at(2) }),
    );
    await until(() => h.participant.calls.install === 1);
    h.clock.advance(2);
    await settle();
    expect(restore.error).toMatchObject({ code: 'deadline_exceeded' });
    const resume = track(h.plane.resume({ checkpoint_id: 'c9', deadline_ts: h.at() }));
    await settle();
    expect(resume.settled).toBe(false);
    h.participant.installGate.open();
    await until(() => resume.settled);
    expect(resume.value).toEqual({ phase: 'idle', idempotent: false });
    expect(h.participant.admissionOpen).toBe(true);
    await settle();
    expect(h.participant.calls.openAdmission).toBe(1);
  });

  test('a later restore takes over from an install that outlived its restore', async () => {
    let readsDone = 0;
    const h = harness({
      storage: {
        write: writeParticipantState,
        read: async (opts) => {
          try {
            return await readParticipantState(opts);
          } finally {
            readsDone += 1;
          }
        },
      },
    });
    await withCheckpoint(h);
    h.participant.installGate = new Gate();
    const first = track(
      h.plane.restore({ ...restoreRequest(h, 'c8', 'src', ['r']), deadline_ts: h.at(2) }),
    );
    await until(() => h.participant.calls.install === 1);
    h.clock.advance(2);
    await settle();
    expect(first.error).toMatchObject({ code: 'deadline_exceeded' });
    const second = track(h.plane.restore(restoreRequest(h, 'c9', 'src', ['r', 't'])));
    await until(() => readsDone === 2);
    await settle();
    expect(second.settled).toBe(false);
    expect(h.participant.calls.install).toBe(1); // waits for the earlier install first
    h.participant.installGate.open();
    await until(() => second.settled);
    expect(second.value).toMatchObject({ phase: 'restored', restored: ['r-a1', 't-a1'] });
    await settle();
    expect(h.participant.calls.openAdmission).toBe(0);
    expect(h.participant.admissionOpen).toBe(false);
  });

  test('a restore that took over and ran out of time too reopens admission only once its own install finished', async () => {
    const h = harness();
    await withCheckpoint(h);
    const firstInstall = new Gate();
    h.participant.installGate = firstInstall;
    const first = track(
      h.plane.restore({ ...restoreRequest(h, 'c8', 'src', ['r']), deadline_ts: h.at(2) }),
    );
    await until(() => h.participant.calls.install === 1);
    h.clock.advance(2);
    await settle();
    expect(first.error).toMatchObject({ code: 'deadline_exceeded' });

    const secondInstall = new Gate();
    const second = track(
      h.plane.restore({ ...restoreRequest(h, 'c9', 'src', ['t']), deadline_ts: h.at(5) }),
    );
    await settle();
    h.participant.installGate = secondInstall;
    firstInstall.open();
    await until(() => h.participant.calls.install === 2);
    h.clock.advance(5);
    await until(() => second.settled);
    expect(second.error).toMatchObject({ code: 'deadline_exceeded' });
    await settle();
    // The first restore's install ended long ago, but the second one's still runs.
    expect(h.participant.admissionOpen).toBe(false);
    secondInstall.open();
    await until(() => h.participant.admissionOpen);
    expect(h.participant.calls.openAdmission).toBe(1);
  });

  test('a completed restore retried with another scope conflicts, with the same scope in another order replays', async () => {
    const h = harness();
    await withCheckpoint(h);
    const first = await h.plane.restore(restoreRequest(h, 'c9', 'src', ['r', 't']));
    await expect(h.plane.restore(restoreRequest(h, 'c9', 'src', ['t', 'r']))).resolves.toBe(first);
    await expect(h.plane.restore(restoreRequest(h, 'c9', 'src', ['r']))).rejects.toMatchObject({
      code: 'checkpoint_conflict',
    });
    expect(h.participant.calls.install).toBe(1);
  });

  test('restore is refused while a checkpoint is open', async () => {
    const h = harness();
    await withCheckpoint(h);
    h.participant.start('x', 'parked');
    await h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() });
    await expect(h.plane.restore(restoreRequest(h, 'c1', 'src', ['r']))).rejects.toMatchObject({
      code: 'invalid_phase',
    });
  });
});
