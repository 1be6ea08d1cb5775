import { CONTROL_VALIDATORS } from '../../src/control/schemas.js';

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
