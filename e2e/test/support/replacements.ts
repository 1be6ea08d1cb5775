/** Checks shared by the e2e tests that continue rollouts after a restore. */
import type { Deployment } from './deployment.js';
import { weatherEpisode } from './stacks.js';

/**
 * Runs every rollout's replacement (attempt 1) `/run` at once and checks each finished with its
 * reward after exactly one model call carrying the whole history: it continued from its boundary
 * and no delivered call repeated.
 */
export async function replacementsContinue(
  dep: Deployment,
  rollouts: readonly string[],
): Promise<void> {
  const replies = await Promise.all(
    rollouts.map((r) => dep.post('env', '/run', weatherEpisode(r, 1)).reply),
  );
  for (const reply of replies) {
    expect(reply.status).toBe(200);
    expect(reply.body.result).toMatchObject({ reward: 1 });
  }
  const calls = await dep.calls();
  for (const r of rollouts) {
    const replacement = calls.filter((c) => c.capture_key === `${r}-a1`);
    expect(replacement.map((c) => c.n_messages)).toEqual([4]);
  }
}
