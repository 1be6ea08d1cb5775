import { harness, settle, track, useHarness } from './harness.js';

useHarness();

describe('prepare', () => {
  test('prepare closes admission and replies prepared once every episode is parked', async () => {
    const h = harness();
    h.participant.start('r', 'parked');
    const reply = await h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() });
    expect(reply).toMatchObject({ phase: 'prepared', report: { ready: true, blockers: [] } });
    expect(h.participant.admissionOpen).toBe(false);
    expect(h.plane.status()).toMatchObject({ phase: 'prepared', checkpoint_id: 'c1' });
  });

  test('a prepare whose deadline already passed is 409 deadline_exceeded and leaves admission open', async () => {
    const h = harness();
    h.participant.start('r', 'parked');
    for (const deadline_ts of [h.at(-1), h.at(0)]) {
      await expect(h.plane.prepare({ checkpoint_id: 'c1', deadline_ts })).rejects.toMatchObject({
        code: 'deadline_exceeded',
        detail: 'deadline passed',
      });
      expect(h.participant.admissionOpen).toBe(true);
      expect(h.plane.status()).toMatchObject({ phase: 'idle', lease_expires_at: null });
    }
    const reply = await h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() });
    expect(reply.phase).toBe('prepared');
  });

  test('the readiness wait wakes on a change notification', async () => {
    const h = harness();
    h.participant.start('r');
    const prepare = track(h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() }));
    await settle();
    expect(prepare.settled).toBe(false);
    // No time passes: only the notification can end the wait.
    h.participant.setState('r', 'parked');
    await settle();
    expect(prepare.value?.phase).toBe('prepared');
  });

  test('the readiness wait asks again at least every second without a notification', async () => {
    const h = harness();
    h.participant.start('r');
    const prepare = track(h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at(30) }));
    await settle();
    const live = h.participant.episodes.get('r');
    if (live) live.state = 'parked'; // changed behind the plane's back, no notification
    await settle();
    expect(prepare.settled).toBe(false);
    h.clock.advance(1);
    await settle();
    expect(prepare.value?.phase).toBe('prepared');
  });

  test('a prepare not ready at its deadline replies preparing with blockers and keeps admission closed', async () => {
    const h = harness();
    h.participant.start('r');
    h.participant.start('s', 'parked');
    const prepare = track(h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at(3) }));
    await settle();
    h.clock.advance(3);
    await settle();
    expect(prepare.error).toBeUndefined();
    expect(prepare.value).toMatchObject({
      phase: 'preparing',
      report: { ready: false, blockers: ['r'], blocker_count: 1 },
    });
    expect(h.participant.admissionOpen).toBe(false);
    expect(h.plane.status().phase).toBe('preparing');
  });

  test('prepare lists blockers only for its reply', async () => {
    const h = harness();
    h.participant.start('r');
    const prepare = track(h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at(5) }));
    for (let i = 0; i < 5; i++) {
      await settle();
      h.clock.advance(1);
    }
    await settle();
    expect(prepare.value?.phase).toBe('preparing');
    expect(h.participant.calls.ready).toBeGreaterThan(3);
    expect(h.participant.calls.readiness).toBe(1);
  });

  test('a repeated prepare of the same checkpoint waits again and may carry more restarts', async () => {
    const h = harness();
    h.participant.start('r');
    h.participant.start('s');
    const first = track(
      h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at(1), restarts: ['r'] }),
    );
    await settle();
    h.clock.advance(1);
    await settle();
    expect(first.value).toMatchObject({ phase: 'preparing', report: { blockers: ['s'] } });
    // `s` is reported as a restart by an earlier stage: never waited for.
    const second = await h.plane.prepare({
      checkpoint_id: 'c1',
      deadline_ts: h.at(1),
      restarts: ['s'],
    });
    expect(second.phase).toBe('prepared');
    expect(h.participant.calls.closeAdmission).toBe(1);
  });

  test('a prepared result replays, also after the commit', async () => {
    const h = harness();
    h.participant.start('r', 'parked');
    const first = await h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() });
    await h.plane.commit({
      checkpoint_id: 'c1',
      deadline_ts: h.at(),
      checkpoint_dir: `${h.dir('c1')}`,
      episode_ids: null,
      stop: false,
    });
    h.participant.setState('r', 'running');
    const again = await h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() });
    expect(again).toEqual(first);
    expect(h.participant.calls.closeAdmission).toBe(1);
  });

  test('a prepare whose closeAdmission throws reopens admission without fencing its id', async () => {
    const h = harness();
    h.participant.closeAdmissionError = new Error('worker 2 did not close');
    await expect(
      h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() }),
    ).rejects.toMatchObject({
      code: 'checkpoint_error',
    });
    expect(h.participant.admissionOpen).toBe(true);
    expect(h.plane.status()).toMatchObject({
      phase: 'idle',
      checkpoint_id: null,
      lease_expires_at: null,
    });
    h.participant.closeAdmissionError = null;
    await expect(
      h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() }),
    ).resolves.toMatchObject({
      phase: 'prepared',
    });
  });

  test('a prepare whose client disconnects reopens admission', async () => {
    const h = harness();
    h.participant.start('r');
    const client = new AbortController();
    const prepare = track(
      h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() }, client.signal),
    );
    await settle();
    expect(h.participant.admissionOpen).toBe(false);
    client.abort(new Error('client disconnected'));
    await settle();
    expect(prepare.error).toMatchObject({ code: 'checkpoint_error' });
    expect(h.participant.admissionOpen).toBe(true);
    expect(h.plane.status().phase).toBe('idle');
  });

  test('a prepare whose checkpoint was resumed while it waited replies the current phase', async () => {
    const h = harness();
    h.participant.start('r');
    const prepare = track(h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() }));
    await settle();
    await h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() });
    await settle();
    expect(prepare.value?.phase).toBe('idle');
  });

  test('a prepare whose reopen fails after closing failed leaves the reopen to the next resume', async () => {
    const h = harness();
    h.participant.closeAdmissionError = new Error('close failed');
    h.participant.openAdmissionFailures = 1;
    await expect(
      h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at() }),
    ).rejects.toMatchObject({
      code: 'checkpoint_error',
    });
    expect(h.participant.admissionOpen).toBe(false);
    await expect(h.plane.resume({ checkpoint_id: 'c1', deadline_ts: h.at() })).resolves.toEqual({
      phase: 'idle',
      idempotent: false,
    });
    expect(h.participant.admissionOpen).toBe(true);
  });

  test('a second checkpoint id while one is open conflicts', async () => {
    const h = harness();
    h.participant.start('r');
    const first = track(h.plane.prepare({ checkpoint_id: 'c1', deadline_ts: h.at(1) }));
    await settle();
    await expect(
      h.plane.prepare({ checkpoint_id: 'c2', deadline_ts: h.at() }),
    ).rejects.toMatchObject({
      code: 'checkpoint_conflict',
    });
    h.clock.advance(1);
    await settle();
    expect(first.value?.phase).toBe('preparing');
  });
});
