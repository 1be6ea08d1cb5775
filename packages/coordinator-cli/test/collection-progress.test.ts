/** The progress line: never throws, whatever the counts; rate and ETA on a terminal only. */
import { formatDuration, progressLine, tenth } from '../src/collection/progress.js';

const state = (done: number, total: number, extra: object = {}) => ({
  done,
  total,
  inFlight: 0,
  doneHere: done,
  elapsedSeconds: 10,
  ...extra,
});

test.each([
  [58, 8], // an output with more rows than the input has tasks ("Invalid count value: -50")
  [-3, 8],
  [0, 0],
  [5, -1],
  [Number.NaN, 4],
])('%p of %p done draws a line', (done, total) => {
  expect(() => progressLine(state(done, total), true)).not.toThrow();
  expect(() => progressLine(state(done, total), false)).not.toThrow();
  expect(tenth(done, total)).toBeGreaterThanOrEqual(0);
  expect(tenth(done, total)).toBeLessThanOrEqual(10);
});

test('a terminal line has the rate of this run and the time left', () => {
  const line = progressLine(state(4, 8, { doneHere: 2, inFlight: 3 }), true);
  expect(line).toBe(`[${'#'.repeat(15)}${'.'.repeat(15)}] 4/8 done, 3 in flight, 0.20/s, ETA 20s`);
  expect(progressLine(state(4, 8), false)).toBe(
    `[${'#'.repeat(15)}${'.'.repeat(15)}] 4/8 done, 0 in flight`,
  );
  expect(progressLine(state(0, 8, { doneHere: 0 }), true)).toMatch(/0\.00\/s, ETA \?$/);
});

test('tenths and durations', () => {
  expect([0, 1, 4, 5, 8].map((d) => tenth(d, 8))).toEqual([0, 1, 5, 6, 10]);
  expect([formatDuration(42), formatDuration(65), formatDuration(-1)]).toEqual([
    '42s',
    '1m05s',
    '0s',
  ]);
});
