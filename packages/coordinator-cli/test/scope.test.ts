import type { ParticipantMember } from '@ckpt-gym/core/client';

import { CliFailure, generatedId, resolveConfigPath, BUNDLED_EXAMPLE } from '../src/context.js';
import { episodesInFlight, openCheckpointId } from '../src/scope.js';

const members: ParticipantMember[] = [
  { server: 'env-a', kind: 'environment', url: 'http://a' },
  { server: 'env-b', kind: 'environment', url: 'http://b' },
  { server: 'policy', kind: 'model', url: 'http://p' },
];

describe('episodesInFlight', () => {
  test('the scope is every environment’s live and restored episodes, minus every restart', () => {
    const inFlight = episodesInFlight(members, {
      'env-a': { episodes: ['r2', 'r1', 'r3'], restored_pending: ['old-a1'] },
      'env-b': { episodes: ['r4'], restored_pending: [] },
      // A model lists no episodes; its restarts still leave the scope.
      policy: { report: { restarts: ['r3'] } },
    });
    expect(inFlight.scope).toEqual([
      { rollout_id: 'old', attempt: 1 },
      { rollout_id: 'r1', attempt: 0 },
      { rollout_id: 'r2', attempt: 0 },
      { rollout_id: 'r4', attempt: 0 },
    ]);
    expect(inFlight.restarts).toEqual(['r3']);
  });

  test('restarts from prepare are left out too', () => {
    const inFlight = episodesInFlight(
      members.slice(0, 1),
      { 'env-a': { episodes: ['r1', 'r2'] } },
      ['r2'],
    );
    expect(inFlight.scope).toEqual([{ rollout_id: 'r1', attempt: 0 }]);
    expect(inFlight.restarts).toEqual(['r2']);
  });

  test('an environment that does not list its episodes is a failure asking for --episodes', () => {
    expect(() => episodesInFlight(members, { 'env-a': { episodes: [] }, 'env-b': {} })).toThrow(
      /env-b does not list its episodes.*--episodes/,
    );
  });

  test('a bad key in a reply is a failure', () => {
    expect(() =>
      episodesInFlight(members.slice(0, 1), { 'env-a': { episodes: ['bad key'] } }),
    ).toThrow(CliFailure);
  });
});

describe('openCheckpointId', () => {
  test('the one open id, or none', () => {
    expect(openCheckpointId({ a: { checkpoint_id: null }, b: { checkpoint_id: 'c1' } })).toBe('c1');
    expect(openCheckpointId({ a: { checkpoint_id: null } })).toBeUndefined();
  });

  test('several open ids are a failure naming them', () => {
    expect(() =>
      openCheckpointId({ a: { checkpoint_id: 'c1' }, b: { checkpoint_id: 'c2' } }),
    ).toThrow(/several checkpoints are open \(c1 on a; c2 on b\); pass --id/);
  });
});

describe('context helpers', () => {
  test('the config is --config, else ./ckpt-gym.yaml when present, else the bundled example', () => {
    expect(resolveConfigPath('s.yaml', '/w')).toBe('/w/s.yaml');
    expect(resolveConfigPath(undefined, '/w', (p) => p === '/w/ckpt-gym.yaml')).toBe(
      '/w/ckpt-gym.yaml',
    );
    expect(resolveConfigPath(undefined, '/w', () => false)).toBe(BUNDLED_EXAMPLE);
    expect(BUNDLED_EXAMPLE).toMatch(/\/examples\/local\.yaml$/);
  });

  test('generated ids are valid checkpoint ids', () => {
    expect(generatedId('ckpt', new Date('2026-11-30T10:45:12.123Z'))).toBe(
      'ckpt-20261130T104512-123Z',
    );
  });
});
