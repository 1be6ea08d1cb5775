/** The participant coordinator's pure rules: the workers' readiness and status merged, held records. */
import { captureKey, episodeId } from '../../src/identity.js';
import { prepareReport } from '../../src/participant.js';
import { HeldRecords, recordAs } from '../../src/workers/held.js';
import { mergeReadiness, mergeStatuses } from '../../src/workers/rules.js';

describe('mergeReadiness', () => {
  const ready = prepareReport({
    blockers: [],
    blockerCount: 0,
    counts: { episodes: 2 },
    restarts: ['x'],
  });
  const busy = prepareReport({
    blockers: ['b', 'a'],
    blockerCount: 2,
    counts: { episodes: 3, sessions: 1 },
    restarts: ['x', 'y'],
  });

  test('ready only when every worker is; blockers and restarts unioned, counts summed', () => {
    expect(mergeReadiness([ready, busy])).toEqual({
      ready: false,
      blockers: ['a', 'b'],
      blocker_count: 2,
      counts: { episodes: 5, sessions: 1 },
      restarts: ['x', 'y'],
    });
    expect(mergeReadiness([ready, ready]).ready).toBe(true);
  });

  test('a worker that says not ready keeps the merge unready even with no blocker listed', () => {
    expect(mergeReadiness([ready, { ...ready, ready: false }]).ready).toBe(false);
  });

  test('no report at all is ready with nothing counted (the layer blocks on unreported workers)', () => {
    expect(mergeReadiness([])).toEqual({
      ready: true,
      blockers: [],
      blocker_count: 0,
      counts: {},
      restarts: [],
    });
  });
});

describe('mergeStatuses', () => {
  test('lists unioned and sorted, numbers summed, anything else left out', () => {
    expect(
      mergeStatuses([
        { episodes: ['b', 'a'], held: 1, mode: 'x' },
        { episodes: ['c', 'a'], held: 2 },
      ]),
    ).toEqual({ episodes: ['a', 'b', 'c'], held: 3 });
  });
});

describe('HeldRecords', () => {
  const record = (rollout: string, attempt: number) => ({
    episode_id: episodeId(rollout, attempt),
    payload: `${rollout}/${attempt}`,
  });

  test("a record is claimed by its replacement's capture key, once", () => {
    const held = new HeldRecords();
    held.hold([record('r1', 0)]);
    expect(held.keys()).toEqual(['r1-a1']);
    expect(held.claim('r1')).toBeUndefined();
    expect(held.claim('r1-a1')).toEqual(record('r1', 0));
    expect(held.claim('r1-a1')).toBeUndefined();
    expect(held.size).toBe(0);
  });

  test('inScope re-exports each record as its next attempt, only where the scope names it', () => {
    const held = new HeldRecords();
    held.hold([record('r1', 0), record('r2', 3)]);
    expect(held.inScope(new Set(['r2-a4']))).toEqual([
      { episode_id: episodeId('r2', 4), payload: 'r2/3' },
    ]);
    expect(held.inScope(new Set(['r1']))).toEqual([]);
    expect(
      held
        .inScope(null)
        .map((r) => captureKey(r.episode_id))
        .sort(),
    ).toEqual(['r1-a1', 'r2-a4']);
    // Held as read: exporting again changes nothing held.
    expect(held.pending().map(captureKey).sort()).toEqual(['r1-a1', 'r2-a4']);
  });

  test("a retire drops the rollout's records whose replacement it covers, and no other", () => {
    const held = new HeldRecords();
    held.hold([record('r1', 0), record('r2', 0)]);
    expect(held.retire(episodeId('r1', 0))).toBe(0);
    expect(held.retire(episodeId('r1', 1))).toBe(1);
    expect(held.keys()).toEqual(['r2-a1']);
  });

  test('recordAs keeps getters unread (a deferred field is not decoded)', () => {
    let reads = 0;
    const lazy = {
      episode_id: episodeId('r1', 0),
      get boundary(): number {
        reads += 1;
        return 1;
      },
    };
    const copy = recordAs(lazy, episodeId('r1', 1));
    expect(reads).toBe(0);
    expect([copy.episode_id, copy.boundary, lazy.episode_id]).toEqual([
      episodeId('r1', 1),
      1,
      episodeId('r1', 0),
    ]);
  });
});
