/**
 * Episodes on the typed `single_agent_turn` path (environment → Simple Agent → policy model →
 * fake backend, weather resources), checkpointed mid-episode by the test as controller.
 */
import { ep, tracked, until } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { weatherEpisode } from './support/stacks.js';

afterEach(closeAll);

/** Runs `r` until its second model call is held at the backend, then checkpoints it as `id`. */
async function checkpointAtSecondCall(dep: Deployment, rollout: string, id: string) {
  await dep.backend('/_ctl/hold', { after_calls: 1 });
  const run = dep.post('env', '/run', weatherEpisode(rollout));
  await dep.waitForCalls(2);
  const { prepared, committed } = await dep.checkpoint(id, [ep(rollout)]);
  expect(prepared.restarts()).toEqual([]);
  expect(committed.env?.episode_ids).toEqual([rollout]);
  return run;
}

describe('single_agent_turn episodes', () => {
  scenario(
    'an episode continues from its last boundary after a crash; no delivered call is repeated',
    async () => {
      const dep = await Deployment.start('native');
      const first = await checkpointAtSecondCall(dep, 'crash-1', 'c1');

      const restored = await dep.crashAndRestore('c1', [ep('crash-1')]);
      expect(restored.env?.restored).toEqual(['crash-1-a1']);
      await expect(first.reply).rejects.toThrow();

      const reply = await dep.post('env', '/run', weatherEpisode('crash-1', 1)).reply;
      expect(reply.status).toBe(200);
      expect(reply.body.failure).toBeNull();
      expect(reply.body.result).toMatchObject({ reward: 1 });
      // Call 0 was delivered and its tool ran; call 1 was never delivered; the replacement makes
      // exactly one call, with the whole history, and never repeats call 0.
      expect(await dep.messageCounts()).toEqual([2, 4, 4]);
      const calls = await dep.calls();
      expect(calls.map((c) => c.capture_key)).toEqual(['crash-1', 'crash-1', 'crash-1-a1']);
      expect(await dep.trackedAfterForget(['crash-1'])).toEqual({});
    },
  );

  scenario(
    'a second crash, after a checkpoint taken before the replacement started, still continues',
    async () => {
      const dep = await Deployment.start('native');
      await checkpointAtSecondCall(dep, 'twice-1', 'c1');
      await dep.crashAndRestore('c1', [ep('twice-1')]);

      // The replacement (attempt 1) is restored but not yet dispatched: the next checkpoint carries
      // it under its replacement attempt.
      const { committed } = await dep.checkpoint('c2', [ep('twice-1', 1)]);
      expect(committed.env?.episode_ids).toEqual(['twice-1-a1']);
      await dep.resume('c2');
      const restored = await dep.crashAndRestore('c2', [ep('twice-1', 1)]);
      expect(restored.env?.restored).toEqual(['twice-1-a2']);

      const reply = await dep.post('env', '/run', weatherEpisode('twice-1', 2)).reply;
      expect(reply.status).toBe(200);
      expect(reply.body.result).toMatchObject({ reward: 1 });
      expect(await dep.messageCounts()).toEqual([2, 4, 4]);
      expect((await dep.calls()).at(-1)?.capture_key).toBe('twice-1-a2');
      expect(await dep.trackedAfterForget(['twice-1'])).toEqual({});
    },
  );

  scenario('a checkpoint without a crash parks the episode and resume releases it', async () => {
    const dep = await Deployment.start('native');
    await dep.backend('/_ctl/hold', { after_calls: 0 });
    const run = dep.post('env', '/run', weatherEpisode('park-1'));
    await dep.waitForCalls(1);

    const { prepared, committed } = await dep.checkpoint('c1', [ep('park-1')]);
    expect(prepared.prepared).toBe(true);
    expect(committed.env?.episode_ids).toEqual(['park-1']);
    // The backend answers; the policy model holds the answer while the checkpoint is open.
    await dep.backend('/_ctl/release', {});
    await until(
      async () => (await dep.calls())[0]?.returned === true,
      'the backend to answer',
      30_000,
    );
    await new Promise((r) => setTimeout(r, 1000));
    expect(run.done()).toBe(false);
    expect(await dep.callCount()).toBe(1);
    expect((await dep.status('policy')).report.counts).toMatchObject({ held: 1 });

    await dep.resume('c1');
    const reply = await run.reply;
    expect(reply.status).toBe(200);
    expect(reply.body.result).toMatchObject({ reward: 1 });
    expect(await dep.messageCounts()).toEqual([2, 4]);
    expect(tracked(await dep.statuses())).toEqual({});
  });
});
