import fc from 'fast-check';

import {
  captureKey,
  covers,
  episodeFromRunBody,
  episodeId,
  episodeIdFromJson,
  InvalidRequestError,
  InvalidRolloutIdError,
  nextAttempt,
  parseCaptureKey,
  parseRolloutPath,
  withRolloutPrefix,
} from '../src/index.js';

describe('capture keys', () => {
  test('attempt 0 is the bare rollout id, attempt N appends -aN without padding', () => {
    expect(captureKey(episodeId('r'))).toBe('r');
    expect(captureKey(episodeId('r', 1))).toBe('r-a1');
    expect(captureKey(episodeId('r', 12))).toBe('r-a12');
  });

  test('parsing splits the reserved -aN suffix', () => {
    expect(parseCaptureKey('r-a3')).toEqual({ rollout_id: 'r', attempt: 3 });
    expect(parseCaptureKey('counter-1-a1')).toEqual({ rollout_id: 'counter-1', attempt: 1 });
  });

  test.each(['x-a1-a2', '-a1', 'a b', '', '.x', 'x\n'])('key %j is refused', (key) => {
    expect(() => parseCaptureKey(key)).toThrow(InvalidRolloutIdError);
  });

  test.each(['x-a0', 'x-a01'])('%s is a rollout id, not an attempt', (key) => {
    expect(parseCaptureKey(key)).toEqual({ rollout_id: key, attempt: 0 });
  });

  test('a rollout id may not end with the reserved suffix', () => {
    expect(() => episodeId('x-a1', 0)).toThrow(/reserved attempt suffix/);
  });

  test('every valid capture key round-trips', () => {
    const rolloutId = fc
      .stringMatching(/^[A-Za-z0-9][A-Za-z0-9._-]{0,20}$/)
      .filter((s) => !/-a[1-9][0-9]*$/.test(s));
    fc.assert(
      fc.property(rolloutId, fc.nat({ max: 1_000_000 }), (r, attempt) => {
        const key = captureKey(episodeId(r, attempt));
        expect(captureKey(parseCaptureKey(key))).toBe(key);
        expect(parseCaptureKey(key)).toEqual({ rollout_id: r, attempt });
      }),
    );
  });

  test('next attempt and covers', () => {
    expect(nextAttempt(episodeId('r', 2))).toEqual({ rollout_id: 'r', attempt: 3 });
    expect(covers(episodeId('r', 2), episodeId('r', 1))).toBe(true);
    expect(covers(episodeId('r', 2), episodeId('r', 2))).toBe(true);
    expect(covers(episodeId('r', 2), episodeId('r', 3))).toBe(false);
    expect(covers(episodeId('r', 2), episodeId('r2', 0))).toBe(false);
  });

  test('episode ids from JSON refuse unknown keys and bad values with the field path', () => {
    expect(episodeIdFromJson({ rollout_id: 'r' })).toEqual({ rollout_id: 'r', attempt: 0 });
    expect(() => episodeIdFromJson({ rollout_id: 'r', extra: 1 }, 'episode_ids/0')).toThrow(
      /episode_ids\/0: unknown keys extra/,
    );
    expect(() => episodeIdFromJson({ rollout_id: 'r', attempt: -1 })).toThrow(InvalidRequestError);
    expect(() => episodeIdFromJson({ rollout_id: 'r', attempt: 1.5 })).toThrow(InvalidRequestError);
  });
});

describe('rollout path prefix', () => {
  test('build and parse', () => {
    expect(withRolloutPrefix('http://h:1/', episodeId('r', 1), '/v1/responses')).toBe(
      'http://h:1/ng-rollout/r-a1/v1/responses',
    );
    expect(parseRolloutPath('/ng-rollout/r-a1/v1/responses?x=1')).toEqual({
      captureKey: 'r-a1',
      episode: { rollout_id: 'r', attempt: 1 },
      rest: '/v1/responses?x=1',
    });
    expect(parseRolloutPath('/v1/responses')).toBeUndefined();
  });

  test('a malformed key in the prefix is invalid_rollout_id', () => {
    expect(() => parseRolloutPath('/ng-rollout/x-a1-a2/verify')).toThrow(InvalidRolloutIdError);
    expect(() => parseRolloutPath('/ng-rollout/a%20b/verify')).toThrow(InvalidRolloutIdError);
  });
});

describe('identity of flat run bodies', () => {
  test('an explicit id wins and runs at the attempt index', () => {
    expect(episodeFromRunBody({ _ng_rollout_id: 'r', _ng_attempt_index: 2 })).toEqual({
      rollout_id: 'r',
      attempt: 2,
    });
  });

  test('an explicit "<id>-aN" runs as attempt N of <id>', () => {
    expect(episodeFromRunBody({ _ng_rollout_id: 'restored-a1' })).toEqual({
      rollout_id: 'restored',
      attempt: 1,
    });
  });

  test('an explicit id ending in -aN cannot also take an attempt index', () => {
    expect(() => episodeFromRunBody({ _ng_rollout_id: 'r-a1', _ng_attempt_index: 2 })).toThrow(
      InvalidRolloutIdError,
    );
  });

  test('without an explicit id the id is <task>-<rollout> at the stamped attempt', () => {
    expect(
      episodeFromRunBody({ _ng_task_index: 3, _ng_rollout_index: 0, _ng_attempt_index: 1 }),
    ).toEqual({ rollout_id: '3-0', attempt: 1 });
    expect(episodeFromRunBody({ _ng_task_index: 3 })).toBeUndefined();
  });

  test('an explicit id that fails the pattern is refused, never sanitised', () => {
    expect(() => episodeFromRunBody({ _ng_rollout_id: 'a b' })).toThrow(InvalidRolloutIdError);
  });
});
