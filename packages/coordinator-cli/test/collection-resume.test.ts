/**
 * The resume rules (#3893): which rows a resumed leg restores, which it retires and restarts, the
 * attempt each is sent as, and what its log carries so a second crash never reuses an attempt.
 */
import {
  type CollectionManifest,
  type DispatchLog,
  logHeadLine,
  logLine,
  parseDispatchLog,
  planResume,
  restartAfterFailedRestore,
} from '../src/collection/resume.js';

const ep = (rollout_id: string, attempt: number) => ({ rollout_id, attempt });

function log(leg: number, attempts: Record<string, number>): DispatchLog {
  return { run_id: 'run-a', leg, attempts: new Map(Object.entries(attempts)) };
}

function manifest(
  leg: number,
  continued: { rollout_id: string; attempt: number }[],
): CollectionManifest {
  return {
    checkpoint_id: 'ckpt-1',
    run_id: 'run-a',
    leg,
    created_at: 1,
    continued,
    restarted: [],
  };
}

test('the previous leg’s checkpoint is restored: its rows go as their next attempt, the rest are fenced', () => {
  // a and b were in flight at the checkpoint; c was sent after it; d was never sent.
  const plan = planResume(
    ['a', 'b', 'c', 'd'],
    log(0, { a: 0, b: 0, c: 0 }),
    manifest(0, [ep('a', 0), ep('b', 0)]),
  );
  expect(plan.continued).toEqual([ep('a', 0), ep('b', 0)]);
  expect(plan.fenced).toEqual([ep('c', 0)]);
  expect(Object.fromEntries(plan.sendAs)).toEqual({ a: 1, b: 1, c: 1, d: 0 });
  expect(plan.stale).toBeUndefined();
});

test('a finished row is neither restored nor fenced, even when the checkpoint continued it', () => {
  const plan = planResume(['b'], log(0, { a: 0, b: 0 }), manifest(0, [ep('a', 0), ep('b', 0)]));
  expect([plan.continued, plan.fenced, [...plan.sendAs.keys()]]).toEqual([[ep('b', 0)], [], ['b']]);
});

test('a checkpoint an older leg published is not restored: every logged row starts over', () => {
  // Leg 1 restored a (attempt 1 carried into its log), then crashed before its own checkpoint.
  const plan = planResume(
    ['a', 'b'],
    log(1, { a: 1, b: 1 }),
    manifest(0, [ep('a', 0), ep('b', 0)]),
  );
  expect(plan.continued).toEqual([]);
  expect(plan.fenced).toEqual([ep('a', 1), ep('b', 1)]);
  expect(Object.fromEntries(plan.sendAs)).toEqual({ a: 2, b: 2 });
  expect(plan.stale).toMatch(/leg 0 published it and leg 1 ran after it/);
});

test('a checkpoint of another run is never restored', () => {
  const other = { ...manifest(0, [ep('a', 0)]), run_id: 'run-b' };
  const plan = planResume(['a'], log(0, { a: 0 }), other);
  expect([plan.continued, plan.fenced, plan.stale]).toEqual([
    [],
    [ep('a', 0)],
    expect.stringContaining('run-b'),
  ]);
});

test('the new log carries the fenced attempts and the attempts a restore installs', () => {
  const plan = planResume(['a', 'c'], log(0, { a: 0, c: 3 }), manifest(0, [ep('a', 0)]));
  expect(plan.carried).toEqual([ep('c', 3), ep('a', 1)]);
});

test('attempts after a second crash never reuse a number the resumed leg used', () => {
  // Leg 0 checkpoints a at attempt 0 and crashes; leg 1 restores it (sending attempt 1), crashes
  // before its first checkpoint; leg 2 must send attempt 2, not 1.
  const leg1 = planResume(['a'], log(0, { a: 0 }), manifest(0, [ep('a', 0)]));
  expect(leg1.sendAs.get('a')).toBe(1);
  const text = logHeadLine({ run_id: 'run-a', leg: 1 }) + leg1.carried.map(logLine).join('');
  const leg2 = planResume(['a'], parseDispatchLog(text, 'log')!, manifest(0, [ep('a', 0)]));
  expect(leg2.fenced).toEqual([ep('a', 1)]);
  expect(leg2.sendAs.get('a')).toBe(2);
});

test('a failed restore retires the attempts it would have installed and restarts after them', () => {
  const fallback = restartAfterFailedRestore([ep('a', 0), ep('b', 4)]);
  expect(fallback.retire).toEqual([ep('a', 1), ep('b', 5)]);
  expect(Object.fromEntries(fallback.sendAs)).toEqual({ a: 2, b: 6 });
});

test('the dispatch log keeps the highest attempt per row and skips a torn last line', () => {
  const text = `${logHeadLine({ run_id: 'run-a', leg: 2 })}${logLine(ep('a', 3))}${logLine(ep('a', 1))}{"rollout_id":"b","att`;
  const parsed = parseDispatchLog(text, 'log')!;
  expect([parsed.run_id, parsed.leg, Object.fromEntries(parsed.attempts)]).toEqual([
    'run-a',
    2,
    { a: 3 },
  ]);
  expect(parseDispatchLog('', 'log')).toBeUndefined();
  expect(() => parseDispatchLog('{"rollout_id":"a","attempt":0}\n', 'the log')).toThrow(
    /the log: its first line/,
  );
});
