import { CONTROL_VALIDATORS, MAX_CONTROL_LIST_LENGTH } from '../../src/control/schemas.js';
import { MAX_ATTEMPT } from '../../src/identity.js';

const base = { checkpoint_id: 'c1', deadline_ts: 1_700_000_000.5 };

function refusal(fn: () => unknown): string {
  try {
    fn();
  } catch (err) {
    expect(err).toMatchObject({ code: 'invalid_request', status: 422 });
    return (err as Error).message;
  }
  throw new Error('expected a refusal');
}

describe('control request schemas', () => {
  test('commit fills in its defaults: no scope, no stop, attempt 0', () => {
    expect(CONTROL_VALIDATORS.commit({ ...base, checkpoint_dir: '/ckpt' })).toEqual({
      ...base,
      checkpoint_dir: '/ckpt',
      episode_ids: null,
      stop: false,
    });
    expect(
      CONTROL_VALIDATORS.commit({
        ...base,
        checkpoint_dir: '/ckpt',
        episode_ids: [{ rollout_id: 'r' }],
      }).episode_ids,
    ).toEqual([{ rollout_id: 'r', attempt: 0 }]);
  });

  test('a checkpoint id must match the pattern and be 1 to 128 characters', () => {
    expect(refusal(() => CONTROL_VALIDATORS.renew({ ...base, checkpoint_id: '' }))).toContain(
      'checkpoint_id',
    );
    expect(refusal(() => CONTROL_VALIDATORS.renew({ ...base, checkpoint_id: '-x' }))).toContain(
      'checkpoint_id',
    );
    expect(
      refusal(() => CONTROL_VALIDATORS.renew({ ...base, checkpoint_id: 'a'.repeat(129) })),
    ).toContain('checkpoint_id');
    expect(
      CONTROL_VALIDATORS.renew({ ...base, checkpoint_id: 'a'.repeat(128) }).checkpoint_id,
    ).toHaveLength(128);
  });

  test('deadline_ts must be a finite number', () => {
    for (const deadline of [NaN, Infinity, '1', null]) {
      expect(
        refusal(() => CONTROL_VALIDATORS.resume({ ...base, deadline_ts: deadline })),
      ).toContain('deadline_ts');
    }
  });

  test('unknown fields are refused by name', () => {
    expect(refusal(() => CONTROL_VALIDATORS.prepare({ ...base, extra: 1 }))).toContain(
      'extra: is not a known field',
    );
    expect(
      refusal(() =>
        CONTROL_VALIDATORS.retire({
          ...base,
          episode_ids: [{ rollout_id: 'r', attempt: 0, x: 1 }],
        }),
      ),
    ).toContain('episode_ids[0].x');
  });

  test('episode ids follow the identity rules, with the field path in the detail', () => {
    const detail = refusal(() =>
      CONTROL_VALIDATORS.restore({
        ...base,
        checkpoint_dir: '/c',
        episode_ids: [{ rollout_id: 'ok' }, { rollout_id: 'x-a1' }],
      }),
    );
    expect(detail).toContain('episode_ids[1].rollout_id');
    expect(detail).toContain('-a<N>');
    expect(
      refusal(() =>
        CONTROL_VALIDATORS.retire({ ...base, episode_ids: [{ rollout_id: 'r', attempt: -1 }] }),
      ),
    ).toContain('episode_ids[0].attempt');
    expect(
      refusal(() =>
        CONTROL_VALIDATORS.retire({ ...base, episode_ids: [{ rollout_id: 'r', attempt: 1.5 }] }),
      ),
    ).toContain('episode_ids[0].attempt');
  });

  test('an attempt is at most MAX_ATTEMPT, a restored one below it (its next attempt is valid)', () => {
    const retire = (attempt: number) =>
      CONTROL_VALIDATORS.retire({ ...base, episode_ids: [{ rollout_id: 'r', attempt }] });
    expect(retire(MAX_ATTEMPT).episode_ids).toEqual([{ rollout_id: 'r', attempt: MAX_ATTEMPT }]);
    for (const attempt of [MAX_ATTEMPT + 1, 2 ** 32, Number.MAX_SAFE_INTEGER]) {
      expect(refusal(() => retire(attempt))).toBe(
        `invalid retire request: episode_ids[0].attempt: must be <= ${MAX_ATTEMPT}`,
      );
      expect(
        refusal(() =>
          CONTROL_VALIDATORS.commit({
            ...base,
            checkpoint_dir: '/c',
            episode_ids: [{ rollout_id: 'r', attempt }],
          }),
        ),
      ).toContain('episode_ids[0].attempt');
    }
    const restore = (attempt: number) =>
      CONTROL_VALIDATORS.restore({
        ...base,
        checkpoint_dir: '/c',
        episode_ids: [{ rollout_id: 'r', attempt }],
      });
    expect(restore(MAX_ATTEMPT - 1).episode_ids).toHaveLength(1);
    expect(refusal(() => restore(MAX_ATTEMPT))).toContain(
      `episode_ids[0].attempt: must be <= ${MAX_ATTEMPT - 1}`,
    );
  });

  test('every control list holds at most MAX_CONTROL_LIST_LENGTH ids', () => {
    const episodes = (n: number) => Array.from({ length: n }, (_, i) => ({ rollout_id: `r${i}` }));
    const ids = (n: number) => Array.from({ length: n }, (_, i) => `r${i}`);
    const bodies = (n: number) => ({
      retire: { ...base, episode_ids: episodes(n) },
      forget: { ...base, rollout_ids: ids(n) },
      prepare: { ...base, restarts: ids(n) },
      commit: { ...base, checkpoint_dir: '/c', episode_ids: episodes(n) },
      restore: { ...base, checkpoint_dir: '/c', episode_ids: episodes(n) },
    });
    const over = bodies(MAX_CONTROL_LIST_LENGTH + 1);
    for (const [route, body] of Object.entries(over)) {
      const field =
        route === 'forget' ? 'rollout_ids' : route === 'prepare' ? 'restarts' : 'episode_ids';
      expect(refusal(() => CONTROL_VALIDATORS[route as keyof typeof over](body))).toBe(
        `invalid ${route} request: ${field}: must NOT have more than ${MAX_CONTROL_LIST_LENGTH} items`,
      );
    }
    expect(
      CONTROL_VALIDATORS.retire({ ...base, episode_ids: episodes(MAX_CONTROL_LIST_LENGTH) })
        .episode_ids,
    ).toHaveLength(MAX_CONTROL_LIST_LENGTH);
  });

  test('retire and forget need at least one id; restore needs its scope, which may be empty', () => {
    expect(refusal(() => CONTROL_VALIDATORS.retire({ ...base, episode_ids: [] }))).toContain(
      'episode_ids',
    );
    expect(refusal(() => CONTROL_VALIDATORS.forget({ ...base, rollout_ids: [] }))).toContain(
      'rollout_ids',
    );
    expect(refusal(() => CONTROL_VALIDATORS.restore({ ...base, checkpoint_dir: '/c' }))).toContain(
      'episode_ids: is required',
    );
    expect(
      CONTROL_VALIDATORS.restore({ ...base, checkpoint_dir: '/c', episode_ids: [] }).episode_ids,
    ).toEqual([]);
  });

  test("prepare's restarts are capture keys", () => {
    expect(CONTROL_VALIDATORS.prepare({ ...base, restarts: ['r', 'r-a2'] }).restarts).toEqual([
      'r',
      'r-a2',
    ]);
    expect(refusal(() => CONTROL_VALIDATORS.prepare({ ...base, restarts: ['x-a1-a2'] }))).toContain(
      'restarts[0]',
    );
  });

  test('commit needs a directory and takes a list, null or nothing as its scope', () => {
    expect(refusal(() => CONTROL_VALIDATORS.commit({ ...base, checkpoint_dir: '' }))).toContain(
      'checkpoint_dir',
    );
    expect(
      CONTROL_VALIDATORS.commit({ ...base, checkpoint_dir: '/c', episode_ids: null }).episode_ids,
    ).toBeNull();
    expect(
      refusal(() => CONTROL_VALIDATORS.commit({ ...base, checkpoint_dir: '/c', episode_ids: 'r' })),
    ).toContain('episode_ids');
    expect(
      refusal(() => CONTROL_VALIDATORS.commit({ ...base, checkpoint_dir: '/c', stop: 'yes' })),
    ).toContain('stop');
  });

  test('a body that is not an object is refused', () => {
    for (const body of [undefined, null, [], 'x', 3]) {
      expect(refusal(() => CONTROL_VALIDATORS.resume(body))).toContain('JSON object');
    }
  });
});
