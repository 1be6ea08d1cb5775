/** `run`'s exit code: a failed capture is a failure of the run, never a silent success. */
import { Outputs } from '../src/collection/outputs.js';
import { runSummary } from '../src/commands/run-summary.js';
import { ExitCode } from '../src/exit-codes.js';

const leg = {
  head: { run_id: 'run-a', leg: 0 },
  dispatches: [],
  forgetLater: [],
  restoredFrom: null,
};
const outcome = {
  written: 2,
  failed: 0,
  finished: 2,
  lost: [],
  captureFailed: [],
  checkpoints: [],
  stoppedAt: undefined,
};
const summary = (changes: object) =>
  runSummary({
    input: '/in.jsonl',
    output: new Outputs('/out.jsonl', 'ckpt-gym'),
    dir: '/ckpt',
    leg,
    total: 2,
    outcome: { ...outcome, ...changes },
  });

test('every reply and every capture clean: exit 0', () => {
  expect(summary({}).exitCode).toBe(ExitCode.OK);
});

test('a failed capture exits 1 and is listed', () => {
  const result = summary({
    failed: 1,
    captureFailed: [
      { episode: { rollout_id: 'run-a.r1', attempt: 1 }, failures: ['c2: worker_capture_failed'] },
    ],
  });
  expect(result.exitCode).toBe(ExitCode.FAILURE);
  expect(result.text).toMatch(
    /token capture FAILED for:[\s\S]*run-a\.r1-a1\s+c2: worker_capture_failed/,
  );
});

test('a row without a reply exits 1; a stop exits 75, saying whether its checkpoint was published', () => {
  expect(
    summary({
      lost: [{ episode: { rollout_id: 'run-a.r2', attempt: 0 }, reason: 'socket hang up' }],
    }).exitCode,
  ).toBe(ExitCode.FAILURE);
  expect(summary({ stoppedAt: 'ckpt-1' }).exitCode).toBe(ExitCode.COLLECTION_STOPPED);
  expect(summary({ stoppedAt: null }).text).toMatch(/after a checkpoint that FAILED/);
});
