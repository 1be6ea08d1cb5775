import fc from 'fast-check';

import { InvalidRequestError, InvalidRolloutIdError } from '../src/errors.js';
import {
  captureKey,
  covers,
  episodeFromRunBody,
  episodeId,
  episodeIdFromJson,
  isRolloutId,
  MAX_ATTEMPT,
  MAX_CAPTURE_KEY_LENGTH,
  MAX_ROLLOUT_ID_LENGTH,
  nextAttempt,
  parseCaptureKey,
  parseRolloutPath,
  withRolloutPrefix,
} from '../src/identity.js';

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

  test('isRolloutId accepts exactly the rollout ids episodeId accepts', () => {
    const accepts = (id: string) => {
      try {
        episodeId(id, 0);
        return true;
      } catch {
        return false;
      }
    };
    const fixed = [
      'r1',
      'a.b_c-d',
      'x-a0',
      'x-a01',
      'x-a1',
      '',
      '-x',
      'a b',
      'r'.repeat(MAX_ROLLOUT_ID_LENGTH),
    ];
    for (const id of [...fixed, `${fixed.at(-1)}r`]) expect(isRolloutId(id)).toBe(accepts(id));
    expect(isRolloutId('x-a1')).toBe(false);
    fc.assert(
      fc.property(
        fc.string({ unit: fc.constantFrom('a', 'Z', '0', '-', '.', '_', ' ', '1') }),
        (id) => {
          expect(isRolloutId(id)).toBe(accepts(id));
        },
      ),
    );
  });

  test('a rollout id is at most MAX_ROLLOUT_ID_LENGTH characters, so its capture keys fit a file name with a suffix', () => {
    const longest = 'r'.repeat(MAX_ROLLOUT_ID_LENGTH);
    const highest = captureKey(episodeId(longest, MAX_ATTEMPT));
    expect([MAX_ROLLOUT_ID_LENGTH, highest.length, MAX_CAPTURE_KEY_LENGTH]).toEqual([
      219, 231, 237,
    ]);
    expect(parseCaptureKey(highest)).toEqual({ rollout_id: longest, attempt: MAX_ATTEMPT });
    const tooLong = `${longest}r`;
    expect(() => episodeId(tooLong)).toThrow(
      new InvalidRolloutIdError(`rollout_id of 220 characters is longer than 219`),
    );
    for (const key of [tooLong, `${tooLong}-a1`, 'r'.repeat(16_384), `${highest}0`]) {
      expect(() => parseCaptureKey(key)).toThrow(InvalidRolloutIdError);
    }
    expect(() => parseRolloutPath(`/ng-rollout/${tooLong}/v1/responses`)).toThrow(
      InvalidRolloutIdError,
    );
    expect(() => episodeIdFromJson({ rollout_id: tooLong })).toThrow(InvalidRequestError);
    // A refusal names the length, not a client's megabytes of id.
    expect(() => parseCaptureKey('r'.repeat(1_000_000))).toThrow(
      `capture key of 1000000 characters is longer than ${MAX_CAPTURE_KEY_LENGTH}`,
    );
  });

  test('an attempt is at most MAX_ATTEMPT: in a capture key 400 invalid_rollout_id, in a body 422', () => {
    expect(parseCaptureKey(`r-a${MAX_ATTEMPT}`)).toEqual({ rollout_id: 'r', attempt: MAX_ATTEMPT });
    for (const attempt of [MAX_ATTEMPT + 1, 2 ** 32, Number.MAX_SAFE_INTEGER, 2 ** 53]) {
      expect(() => parseCaptureKey(`r-a${attempt}`)).toThrow(
        new InvalidRolloutIdError(
          `capture key "r-a${attempt}" has an attempt above ${MAX_ATTEMPT}`,
        ),
      );
      expect(() => episodeId('r', attempt)).toThrow(InvalidRolloutIdError);
      expect(() => episodeIdFromJson({ rollout_id: 'r', attempt })).toThrow(InvalidRequestError);
      expect(() => parseRolloutPath(`/ng-rollout/r-a${attempt}/v1/responses`)).toThrow(
        InvalidRolloutIdError,
      );
    }
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

  test('a rollout id longer than MAX_ROLLOUT_ID_LENGTH is refused, explicit or built from the indices', () => {
    const id = 'r'.repeat(MAX_ROLLOUT_ID_LENGTH);
    expect(episodeFromRunBody({ _ng_rollout_id: id })).toEqual({ rollout_id: id, attempt: 0 });
    for (const row of [
      { _ng_rollout_id: `${id}r` },
      { _ng_rollout_id: `${id}r-a1` },
      { _ng_task_index: 'r'.repeat(20_000), _ng_rollout_index: 0 },
      { _ng_task_index: 1, _ng_rollout_index: id },
    ]) {
      expect(() => episodeFromRunBody(row)).toThrow(InvalidRolloutIdError);
    }
  });

  test.each([[{ toString: null }], [[{ valueOf: 1 }]], [[1]], [true], [{ a: 1 }]])(
    'an index that is neither a string nor a number (%j) is invalid_rollout_id, never stringified',
    (index) => {
      for (const row of [
        { _ng_task_index: index, _ng_rollout_index: 0 },
        { _ng_task_index: 0, _ng_rollout_index: index },
      ]) {
        expect(() => episodeFromRunBody(row)).toThrow(
          /^_ng_(task|rollout)_index must be a string or a number, got (object|array|boolean)$/,
        );
        expect(() => episodeFromRunBody(row)).toThrow(InvalidRolloutIdError);
      }
    },
  );

  test('string, number and bigint indices name the rollout', () => {
    expect(episodeFromRunBody({ _ng_task_index: 'task', _ng_rollout_index: 2 })).toEqual({
      rollout_id: 'task-2',
      attempt: 0,
    });
    expect(
      episodeFromRunBody({ _ng_task_index: 2n ** 64n, _ng_rollout_index: 0 })?.rollout_id,
    ).toBe('18446744073709551616-0');
  });
});
