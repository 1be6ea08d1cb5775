/** Run ids and the rollout ids derived from them. */
import { MAX_ROLLOUT_ID_LENGTH } from '@ckpt-gym/core/protocol';

import { newRunId, rolloutIdFor } from '../src/collection/identity.js';
import { ExitCode } from '../src/exit-codes.js';

test('a run id is its start time and a random part; two runs of one second differ', () => {
  const now = new Date('2026-12-01T14:05:12.345Z');
  expect(newRunId(now, 'a1b2c3')).toBe('run-20261201T140512-a1b2c3');
  expect(newRunId(now)).not.toBe(newRunId(now));
});

test('a rollout id is the run id and the task key; two runs never share one', () => {
  expect(rolloutIdFor('run-x', 'r1')).toBe('run-x.r1');
  expect(rolloutIdFor('run-x', 'r1')).not.toBe(rolloutIdFor('run-y', 'r1'));
});

test('a derived id core would refuse is a usage error naming the task', () => {
  const longest = 'k'.repeat(MAX_ROLLOUT_ID_LENGTH - 'run-x.'.length);
  expect(rolloutIdFor('run-x', longest)).toHaveLength(MAX_ROLLOUT_ID_LENGTH);
  expect(() => rolloutIdFor('run-x', `${longest}k`)).toThrow(
    expect.objectContaining({
      exitCode: ExitCode.USAGE,
      message: expect.stringMatching(/over 219/),
    }),
  );
  expect(() => rolloutIdFor('run-x', 'retry-a2')).toThrow(
    expect.objectContaining({
      exitCode: ExitCode.USAGE,
      message: expect.stringMatching(/reserved attempt suffix/),
    }),
  );
});
