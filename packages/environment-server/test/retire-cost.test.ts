/**
 * A retire's work follows the rollout it names, never its attempt number or the other rollouts
 * tracked (issue 25 item 6): the participant looks up the rollout's own keys.
 */
import { describe, expect, it, jest } from '@jest/globals';

import { type EnvironmentRecord, EnvironmentParticipant } from '../src/participant.js';

function record(rolloutId: string, attempt: number): EnvironmentRecord {
  return { episode_id: { rollout_id: rolloutId, attempt }, task_digest: 'd', boundary: null };
}

describe('retire cost', () => {
  it('a retire looks at its rollout’s tracked keys only, whatever the attempt it names', async () => {
    const participant = new EnvironmentParticipant('env');
    const others = Array.from({ length: 2_000 }, (_, i) => record(`other-${i}`, 0));
    await participant.install([record('r', 4), ...others]);
    const has = jest.spyOn(participant.steps, 'has');
    const keys = jest.spyOn(participant.steps, 'keys');
    for (const attempt of [1_000, 3_000_000, 2 ** 31 - 1]) {
      await participant.retire({ rollout_id: 'r', attempt: 1 });
      await participant.retire({ rollout_id: 'q', attempt });
    }
    expect(participant.restoredPending()).toHaveLength(2_001);
    await participant.retire({ rollout_id: 'r', attempt: 3_000_000 });
    expect(participant.restoredPending()).toHaveLength(2_000);
    // Only r-a5 is looked up (is it live? is it still held once freed?), no other key is scanned.
    expect([has.mock.calls.length, keys.mock.calls.length]).toEqual([2, 0]);
  });

  it('a retire frees exactly the restored records it covers, a delete the one it names', async () => {
    const participant = new EnvironmentParticipant('env');
    await participant.install([record('r', 0), record('s', 2)]);
    await participant.deleteRestored({ rollout_id: 'r', attempt: 1 });
    await participant.retire({ rollout_id: 's', attempt: 2 });
    expect(participant.restoredPending()).toEqual([{ rollout_id: 's', attempt: 3 }]);
    await participant.retire({ rollout_id: 's', attempt: 3 });
    expect(participant.restoredPending()).toEqual([]);
  });
});
