import { captureKey, type EpisodeId, nextAttempt } from '@ckpt-gym/core/protocol';
import { BaseParticipant, type CheckpointRecord, prepareReport } from '@ckpt-gym/core/server';

import { ep, participantHarness } from '../src/index.js';

interface CounterRecord extends CheckpointRecord {
  count: number;
}

/** A user's own participant: one counter per episode, parked between requests. */
class Counters extends BaseParticipant<CounterRecord> {
  readonly counts = new Map<string, { episode: EpisodeId; count: number }>();
  readonly running = new Set<string>();
  constructor() {
    super('resources', 'counters');
  }
  async closeAdmission(): Promise<void> {}
  async openAdmission(): Promise<void> {}
  ready(): boolean {
    return this.running.size === 0;
  }
  readiness() {
    return prepareReport({ blockers: this.running, blockerCount: this.running.size });
  }
  async export(scope: readonly EpisodeId[] | null): Promise<CounterRecord[]> {
    const keys = scope === null ? null : new Set(scope.map(captureKey));
    return [...this.counts]
      .filter(([key]) => keys === null || keys.has(key))
      .map(([, { episode, count }]) => ({ episode_id: episode, count }));
  }
  validateRecord(record: Record<string, unknown>): CounterRecord {
    if (typeof record.count !== 'number') throw new Error('no count');
    return record as unknown as CounterRecord;
  }
  async install(records: CounterRecord[]): Promise<void> {
    for (const { episode_id, count } of records) {
      const next = nextAttempt(episode_id);
      this.counts.set(captureKey(next), { episode: next, count });
    }
  }
  restoredPending(): EpisodeId[] {
    return [];
  }
  async retire(): Promise<void> {}
}

test('the README example: prepare, commit, then restore into a fresh participant', async () => {
  const first = new Counters();
  first.counts.set('r1', { episode: ep('r1'), count: 5 });
  await using h = await participantHarness(first);
  expect((await h.prepare('c1')).phase).toBe('prepared');
  expect((await h.commit('c1', ['r1'])).episode_ids).toEqual(['r1']);

  const fresh = new Counters(); // as after a crash: a new process, the same checkpoint root
  await using after = await participantHarness(fresh, { root: h.root });
  expect((await after.restore('c1-restore', 'c1', ['r1'])).restored).toEqual(['r1-a1']);
  await after.resume('c1-restore');
  expect(fresh.counts.get('r1-a1')?.count).toBe(5);
});

test('prepare waits on the fake clock: a blocked participant times out only when time passes', async () => {
  const counters = new Counters();
  counters.running.add('r1');
  await using h = await participantHarness(counters);
  const prepared = h.prepare('c1');
  let settled = false;
  void prepared.then(
    () => (settled = true),
    () => (settled = true),
  );
  await new Promise((r) => setImmediate(r));
  expect(settled).toBe(false);
  h.clock.advance(11);
  await expect(prepared).resolves.toMatchObject({ report: { ready: false, blockers: ['r1'] } });
});

test('disposing the harness removes its checkpoint root, not one it was given', async () => {
  const { existsSync } = await import('node:fs');
  let root = '';
  {
    await using h = await participantHarness(new Counters());
    root = h.root;
    {
      await using borrowed = await participantHarness(new Counters(), { root });
      expect(borrowed.root).toBe(root);
    }
    expect(existsSync(root)).toBe(true);
  }
  expect(existsSync(root)).toBe(false);
});

test('disposing the harness disposes its plane: the lease timer a prepare set is cancelled', async () => {
  let clock: { pendingTimers: number } | undefined;
  {
    await using h = await participantHarness(new Counters());
    clock = h.clock;
    expect((await h.prepare('c1')).phase).toBe('prepared');
    expect(h.clock.pendingTimers).toBeGreaterThan(0); // the lease, on the fake clock
  }
  expect(clock.pendingTimers).toBe(0);
});
