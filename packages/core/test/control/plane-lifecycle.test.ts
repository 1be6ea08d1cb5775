import { CONTROL_CONCURRENCY, RESUMED_IDS_KEPT } from '../../src/control/plane.js';
import { Gate } from '../support/test-participant.js';
import {
  commitRequest,
  ep,
  eps,
  harness,
  prepared,
  restoreRequest,
  settle,
  track,
  until,
  useHarness,
  writeCheckpoint,
} from './harness.js';

useHarness();

describe('retire', () => {
  test('a retire marks its attempts first and replies only after the participant stopped them', async () => {
    const h = harness();
    h.participant.start('r-a1');
    h.participant.retireGate = new Gate();
    const retire = track(
      h.plane.retire({ checkpoint_id: 'any', deadline_ts: h.at(), episode_ids: eps('r-a1') }),
    );
    await settle();
    expect(h.participant.marks.isRetired(ep('r'))).toBe(true);
    expect(retire.settled).toBe(false);
    h.participant.retireGate.open();
    await until(() => retire.settled);
    expect(retire.value).toEqual({ retired_count: 1 });
    expect(h.participant.episodes.size).toBe(0);
  });

  test('a retire past its deadline still refuses its attempts', async () => {
    const h = harness();
    await expect(
      h.plane.retire({ checkpoint_id: 'any', deadline_ts: h.at(-1), episode_ids: eps('r-a2') }),
    ).rejects.toMatchObject({ code: 'deadline_exceeded' });
    expect(h.participant.marks.isRetired(ep('r-a2'))).toBe(true);
    expect(h.participant.marks.isRetired(ep('r-a3'))).toBe(false);
  });

  test('a failed retire keeps its attempts refused, and a retry stops them', async () => {
    const h = harness();
    h.participant.start('r');
    h.participant.retireError = new Error('session close failed');
    await expect(
      h.plane.retire({ checkpoint_id: 'x', deadline_ts: h.at(), episode_ids: eps('r') }),
    ).rejects.toMatchObject({
      code: 'checkpoint_error',
      message: expect.stringContaining('retire'),
    });
    expect(h.participant.marks.isRetired(ep('r'))).toBe(true);
    h.participant.retireError = null;
    await h.plane.retire({ checkpoint_id: 'x', deadline_ts: h.at(), episode_ids: eps('r') });
    expect(h.participant.calls.retire).toEqual(['r', 'r']);
    expect(h.participant.episodes.size).toBe(0);
  });

  test('a retire stops each rollout once, through its latest attempt', async () => {
    const h = harness();
    const reply = await h.plane.retire({
      checkpoint_id: 'x',
      deadline_ts: h.at(),
      episode_ids: eps('r', 'r-a2', 's-a1', 'r-a1'),
    });
    expect(reply).toEqual({ retired_count: 4 });
    expect([...h.participant.calls.retire].sort()).toEqual(['r-a2', 's-a1']);
    expect(h.participant.marks.highestRetired('r')).toBe(2);
  });

  test('a retire stops its episodes concurrently, a bounded number at a time', async () => {
    const h = harness();
    const keys = Array.from({ length: CONTROL_CONCURRENCY + 36 }, (_, i) => `r${i}`);
    h.participant.retireGate = new Gate();
    const retire = track(
      h.plane.retire({ checkpoint_id: 'x', deadline_ts: h.at(), episode_ids: eps(...keys) }),
    );
    await until(() => h.participant.calls.retire.length === CONTROL_CONCURRENCY);
    await settle();
    expect(h.participant.retiresInFlight).toBe(CONTROL_CONCURRENCY);
    h.participant.retireGate.open();
    await until(() => retire.settled);
    expect(h.participant.calls.retire).toHaveLength(keys.length);
    expect(h.participant.maxRetiresInFlight).toBe(CONTROL_CONCURRENCY);
  });

  test('a retire cut short by its deadline starts no further retires', async () => {
    const h = harness();
    const keys = Array.from({ length: CONTROL_CONCURRENCY + 10 }, (_, i) => `r${i}`);
    h.participant.retireGate = new Gate();
    const retire = track(
      h.plane.retire({ checkpoint_id: 'x', deadline_ts: h.at(2), episode_ids: eps(...keys) }),
    );
    await until(() => h.participant.calls.retire.length === CONTROL_CONCURRENCY);
    h.clock.advance(2);
    await settle();
    expect(retire.error).toMatchObject({ code: 'deadline_exceeded' });
    h.participant.retireGate.open();
    await settle();
    expect(h.participant.calls.retire).toHaveLength(CONTROL_CONCURRENCY);
    expect(keys.every((key) => h.participant.marks.isRetired(ep(key)))).toBe(true);
  });

  test('a straggler is retired after resume, not while a checkpoint is open', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    await expect(
      h.plane.retire({ checkpoint_id: 'c1', deadline_ts: h.at(), episode_ids: eps('r') }),
    ).rejects.toMatchObject({
      code: 'invalid_phase',
      message: expect.stringContaining('resume first'),
    });
    expect(h.participant.marks.size).toBe(0);
    await h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() });
    await expect(
      h.plane.retire({ checkpoint_id: 'c1', deadline_ts: h.at(), episode_ids: eps('r') }),
    ).resolves.toEqual({ retired_count: 1 });
  });

  test('retire while restored is fenced to the restored checkpoint and renews its lease', async () => {
    const h = harness();
    await writeCheckpoint(h, 'src', [{ key: 'r', payload: 1 }]);
    await h.plane.restore(restoreRequest(h, 'c9', 'src', ['r']));
    const before = h.plane.status().lease_expires_at as number;
    await expect(
      h.plane.retire({ checkpoint_id: 'other', deadline_ts: h.at(), episode_ids: eps('r-a1') }),
    ).rejects.toMatchObject({ code: 'checkpoint_conflict' });
    await h.plane.retire({ checkpoint_id: 'c9', deadline_ts: h.at(100), episode_ids: eps('r-a1') });
    expect(h.plane.status().lease_expires_at).toBe(Math.max(before, h.at(100) + 60));
  });
});

describe('forget', () => {
  test('forget ends the refusal and replies how many rollouts had a mark', async () => {
    const h = harness();
    await h.plane.retire({
      checkpoint_id: 'x',
      deadline_ts: h.at(),
      episode_ids: eps('r', 's-a1'),
    });
    await expect(
      h.plane.forget({ checkpoint_id: 'y', deadline_ts: h.at(), rollout_ids: ['r', 'r', 'never'] }),
    ).resolves.toEqual({ forgotten_count: 1 });
    expect(h.participant.marks.isRetired(ep('r'))).toBe(false);
    expect(h.participant.marks.isRetired(ep('s'))).toBe(true);
    expect(h.plane.status().retired_rollouts).toBe(1);
  });

  test('forget is refused while a checkpoint is open', async () => {
    const h = harness();
    await h.plane.retire({ checkpoint_id: 'x', deadline_ts: h.at(), episode_ids: eps('r') });
    await prepared(h, 'c1');
    await expect(
      h.plane.forget({ checkpoint_id: 'c1', deadline_ts: h.at(), rollout_ids: ['r'] }),
    ).rejects.toMatchObject({ code: 'invalid_phase' });
    expect(h.participant.marks.isRetired(ep('r'))).toBe(true);
  });

  test('forget of a rollout whose retired state is still held is refused with retire_incomplete', async () => {
    const h = harness();
    await h.plane.retire({ checkpoint_id: 'x', deadline_ts: h.at(), episode_ids: eps('r') });
    h.participant.holdingState.add('r');
    await expect(
      h.plane.forget({ checkpoint_id: 'x', deadline_ts: h.at(), rollout_ids: ['r'] }),
    ).rejects.toMatchObject({ code: 'retire_incomplete' });
    expect(h.participant.marks.isRetired(ep('r'))).toBe(true);
  });
});

describe('resume', () => {
  test('resume reopens admission, fences the id and drops its recorded results', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    await h.plane.commit(commitRequest(h, 'c1', ['r']));
    await expect(h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() })).resolves.toEqual({
      phase: 'idle',
      idempotent: false,
    });
    expect(h.participant.admissionOpen).toBe(true);
    expect(h.plane.status()).toMatchObject({
      phase: 'idle',
      checkpoint_id: null,
      lease_expires_at: null,
    });
    for (const op of ['prepare', 'commit', 'renew'] as const) {
      const call =
        op === 'commit'
          ? h.plane.commit(commitRequest(h, 'c1', ['r']))
          : h.plane[op]({ checkpoint_id: 'c1', deadline_ts: h.at() });
      await expect(call).rejects.toMatchObject({ code: 'stale_checkpoint' });
    }
    await expect(h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() })).resolves.toEqual({
      phase: 'idle',
      idempotent: true,
    });
  });

  test('resume while idle remembers the id, so a delayed prepare of it is fenced', async () => {
    const h = harness();
    await expect(h.plane.resume({ checkpoint_id: 'late', deadline_ts: h.at() })).resolves.toEqual({
      phase: 'idle',
      idempotent: true,
    });
    await expect(
      h.plane.prepare({ checkpoint_id: 'late', deadline_ts: h.at() }),
    ).rejects.toMatchObject({
      code: 'stale_checkpoint',
    });
    expect(h.participant.calls.openAdmission).toBe(0);
  });

  test('resume of another checkpoint than the open one conflicts', async () => {
    const h = harness();
    await prepared(h, 'c1');
    await expect(
      h.plane.resume({ checkpoint_id: 'c2', deadline_ts: h.at() }),
    ).rejects.toMatchObject({
      code: 'checkpoint_conflict',
    });
    expect(h.plane.status().phase).toBe('prepared');
  });

  test(`the last ${RESUMED_IDS_KEPT} resumed ids are refused with stale_checkpoint`, async () => {
    const h = harness();
    const ids = Array.from({ length: RESUMED_IDS_KEPT + 1 }, (_, i) => `c${i}`);
    for (const id of ids) await h.plane.resume({ checkpoint_id: id, deadline_ts: h.at() });
    for (const id of ids.slice(1)) {
      await expect(
        h.plane.prepare({ checkpoint_id: id, deadline_ts: h.at() }),
      ).rejects.toMatchObject({
        code: 'stale_checkpoint',
      });
    }
    // The oldest was evicted.
    await expect(
      h.plane.prepare({ checkpoint_id: 'c0', deadline_ts: h.at() }),
    ).resolves.toMatchObject({
      phase: 'prepared',
    });
  });

  test('resume waits for a cleanup that outlived its commit; one out of time keeps the phase and succeeds on retry', async () => {
    const h = harness();
    h.participant.restored.set('u-a1', { episode: ep('u-a1'), payload: 0 });
    await prepared(h, 'c1', ['r']);
    h.participant.deleteGate = new Gate();
    const commit = track(h.plane.commit(commitRequest(h, 'c1', ['r'], { deadline_ts: h.at(2) })));
    await until(() => h.participant.calls.deleteRestored.length === 1);
    h.clock.advance(2);
    await settle();
    expect(commit.error).toMatchObject({ code: 'deadline_exceeded' });

    const resume = track(h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at(2) }));
    await settle();
    h.clock.advance(2);
    await settle();
    expect(resume.error).toMatchObject({
      code: 'deadline_exceeded',
      message: expect.stringContaining('resume again'),
    });
    expect(h.plane.status()).toMatchObject({ phase: 'prepared', checkpoint_id: 'c1' });
    expect(h.participant.admissionOpen).toBe(false);

    const retry = track(h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() }));
    await settle();
    expect(retry.settled).toBe(false);
    h.participant.deleteGate.open();
    await until(() => retry.settled);
    expect(retry.value).toEqual({ phase: 'idle', idempotent: false });
    expect(h.participant.restored.size).toBe(0);
  });

  test('a resume whose reopen fails keeps the phase and succeeds on retry', async () => {
    const h = harness();
    await prepared(h, 'c1');
    h.participant.openAdmissionFailures = 1;
    await expect(
      h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() }),
    ).rejects.toMatchObject({
      code: 'checkpoint_error',
      message: expect.stringContaining('resume'),
    });
    expect(h.plane.status().phase).toBe('prepared');
    await expect(h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() })).resolves.toEqual({
      phase: 'idle',
      idempotent: false,
    });
  });
});

describe('lease', () => {
  test('renew extends the lease to the deadline plus the grace, never earlier', async () => {
    const h = harness();
    await prepared(h, 'c1');
    const first = h.plane.status().lease_expires_at as number;
    expect(first).toBe(h.at() + 60);
    await expect(h.plane.renew({ checkpoint_id: 'c1', deadline_ts: h.at(500) })).resolves.toEqual({
      lease_expires_at: h.at(560),
    });
    await expect(h.plane.renew({ checkpoint_id: 'c1', deadline_ts: h.at(1) })).resolves.toEqual({
      lease_expires_at: h.at(560),
    });
  });

  test('renew is refused while idle', async () => {
    const h = harness();
    await expect(h.plane.renew({ checkpoint_id: 'c1', deadline_ts: h.at() })).rejects.toMatchObject(
      {
        code: 'invalid_phase',
      },
    );
  });

  test('an expired lease aborts the checkpoint like a resume and fences its id', async () => {
    const h = harness();
    await prepared(h, 'c1', ['r']);
    h.clock.advance(10 + 59);
    await settle();
    expect(h.plane.status().phase).toBe('prepared');
    h.clock.advance(1);
    await until(() => h.plane.status().phase === 'idle');
    expect(h.participant.admissionOpen).toBe(true);
    await expect(
      h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() }),
    ).rejects.toMatchObject({
      code: 'stale_checkpoint',
    });
  });

  test('a renewed lease does not expire at its earlier time', async () => {
    const h = harness();
    await prepared(h, 'c1');
    await h.plane.renew({ checkpoint_id: 'c1', deadline_ts: h.at(200) });
    h.clock.advance(100);
    await settle();
    expect(h.plane.status().phase).toBe('prepared');
    h.clock.advance(160);
    await until(() => h.plane.status().phase === 'idle');
  });

  test('lease expiry retries its reopen after an error', async () => {
    const h = harness({ leaseRetrySeconds: 30 });
    await prepared(h, 'c1');
    h.participant.openAdmissionFailures = 1;
    h.clock.advance(70);
    await until(() => h.participant.calls.openAdmission === 1);
    await settle();
    expect(h.plane.status().phase).toBe('prepared');
    h.clock.advance(29);
    await settle();
    expect(h.participant.calls.openAdmission).toBe(1);
    h.clock.advance(1);
    await until(() => h.plane.status().phase === 'idle');
    expect(h.participant.admissionOpen).toBe(true);
  });

  test('a lease expiry that runs out of time waiting for a cleanup keeps the phase and succeeds on retry', async () => {
    const h = harness({ leaseRetrySeconds: 30 });
    h.participant.restored.set('u-a1', { episode: ep('u-a1'), payload: 0 });
    await prepared(h, 'c1');
    h.participant.deleteGate = new Gate();
    const commit = track(h.plane.commit(commitRequest(h, 'c1', [], { deadline_ts: h.at(2) })));
    await until(() => h.participant.calls.deleteRestored.length === 1);
    h.clock.advance(2);
    await settle();
    expect(commit.error).toMatchObject({ code: 'deadline_exceeded' });
    h.clock.advance(70); // the lease expires; its reopen waits up to 30 s for the cleanup
    await settle();
    h.clock.advance(30);
    await settle();
    expect(h.plane.status().phase).toBe('prepared');
    h.participant.deleteGate.open();
    await settle();
    h.clock.advance(30);
    await until(() => h.plane.status().phase === 'idle');
    expect(h.participant.restored.size).toBe(0);
  });

  test('resume clears the lease timer and dispose clears every timer', async () => {
    const h = harness();
    await prepared(h, 'c1');
    expect(h.clock.pendingTimers).toBe(1);
    await h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() });
    expect(h.clock.pendingTimers).toBe(0);
    await prepared(h, 'c2');
    h.plane.dispose();
    expect(h.clock.pendingTimers).toBe(0);
  });
});

describe('status and errors', () => {
  test('status reports the phase, lease, retired rollouts, a report and the participant extras', async () => {
    const h = harness();
    h.participant.start('r');
    h.participant.start('x', 'restart');
    await h.plane.retire({ checkpoint_id: 'x', deadline_ts: h.at(), episode_ids: eps('z') });
    expect(h.plane.status()).toEqual({
      kind: 'environment',
      instance: 'test',
      phase: 'idle',
      checkpoint_id: null,
      lease_expires_at: null,
      retired_rollouts: 1,
      report: {
        ready: false,
        blockers: ['r'],
        blocker_count: 1,
        counts: { episodes: 2 },
        restarts: ['x'],
      },
      last_checkpoint: {
        checkpoint_id: 'x',
        operations: { retire: expect.objectContaining({ outcome: 'ok', episodes: 1 }) },
      },
      accepting: true,
    });
  });

  test('a participant hook that throws a non-typed error is a typed checkpoint_error naming the operation', async () => {
    const h = harness();
    h.participant.readiness = () => {
      throw new TypeError('cannot read blockers');
    };
    expect(() => h.plane.status()).toThrow(
      expect.objectContaining({
        code: 'checkpoint_error',
        message: expect.stringContaining('status'),
      }),
    );
    h.participant.start('r', 'parked');
    await expect(
      h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() }),
    ).rejects.toMatchObject({
      code: 'checkpoint_error',
      message: expect.stringContaining('checkpoint prepare failed: cannot read blockers'),
    });
  });
});
