/** Output identity (ours and NeMo Gym's rows) and the capture failures of a lineage ledger. */
import { captureFailuresIn, ckptOutputRow, outcomesIn } from '../src/collection/rows.js';

test('the rollouts with an outcome and their runs, from our rows and NeMo Gym rows', () => {
  const ours = `${JSON.stringify({ run_id: 'run-a', rollout_id: 'run-a.r1' })}\n`;
  const nemo = `${JSON.stringify({ _ng_run_id: 'run-a', _ng_rollout_id: 'run-a.0-0', reward: 1 })}\n{"torn`;
  const old = JSON.stringify({ rollout_id: 'r1', attempt: 0 });
  expect(outcomesIn([ours, nemo])).toEqual({
    finished: new Set(['run-a.r1', 'run-a.0-0']),
    runs: new Set(['run-a']),
  });
  expect(outcomesIn([old]).runs).toEqual(new Set(['(no run id)']));
});

test('a lineage row with a failure_reason is a capture failure', () => {
  const ledger = [
    JSON.stringify({ model_call_id: 'c1', cum_len: 10 }),
    JSON.stringify({ model_call_id: 'c2', failure_reason: 'worker_capture_failed' }),
    '',
  ].join('\n');
  expect(captureFailuresIn(ledger)).toEqual(['c2: worker_capture_failed']);
  expect(captureFailuresIn('')).toEqual([]);
});

test('our output row carries the run id, and the capture failures when there are some', () => {
  const row = {
    rollout_id: 'run-a.r1',
    attempt: 0,
    task_id: { taskset: 't', task_id: '1' },
    result: {},
    failure: null,
  };
  expect(ckptOutputRow('run-a', row, [])).toEqual({ run_id: 'run-a', ...row });
  expect(ckptOutputRow('run-a', row, ['c2: x']).capture_failures).toEqual(['c2: x']);
});
