/**
 * A deployment mixing saved episodes (weather) with a `restart_only` resources server: the
 * restart never holds up a checkpoint; after a crash it starts over while the saved one continues.
 */
import { retire } from '@ckpt-gym/core/client';
import { deadline, ep, tracked } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { weatherEpisode } from './support/stacks.js';

afterEach(closeAll);

/** Both episodes wait at their first model call; the checkpoint is prepared regardless. */
async function checkpointBoth(dep: Deployment) {
  await dep.backend('/_ctl/hold', { after_calls: 0 });
  const saved = dep.post('env', '/run', weatherEpisode('saved-1'));
  const restart = dep.post('restart_env', '/run', weatherEpisode('restart-1'));
  await dep.waitForCalls(2);
  const { prepared, committed } = await dep.checkpoint('c1', [ep('saved-1'), ep('restart-1')]);
  expect(prepared.restarts()).toEqual([ep('restart-1')]);
  expect(committed.env?.episode_ids).toEqual(['saved-1']);
  expect(committed.restart_env?.episode_ids).toEqual([]);
  expect((await dep.records('c1', 'environment', 'restart_env')).length).toBe(0);
  return { saved, restart };
}

function keysAndCounts(calls: { capture_key: string | null; n_messages: number }[]) {
  const out: Record<string, number[]> = {};
  for (const call of calls) (out[call.capture_key ?? '-'] ??= []).push(call.n_messages);
  return out;
}

scenario(
  'a restart never holds up a checkpoint and starts over after a crash; the saved episode continues',
  async () => {
    const dep = await Deployment.start('mixed');
    await checkpointBoth(dep);
    await dep.crashAndRestore('c1', [ep('saved-1')]);
    await retire(dep.participants(), 'retire-restarts', [ep('restart-1')], deadline(30));

    const [saved, restart] = await Promise.all([
      dep.post('env', '/run', weatherEpisode('saved-1', 1)).reply,
      dep.post('restart_env', '/run', weatherEpisode('restart-1', 1)).reply,
    ]);
    expect(saved.status).toBe(200);
    expect(saved.body.result).toMatchObject({ reward: 1 });
    expect(restart.status).toBe(200);
    expect(restart.body.result).toMatchObject({ reward: 1 });
    // Neither first call was delivered before the crash, so both attempts 1 make both calls; the
    // saved one continues from its restored boundary, the restart from its input.
    expect(keysAndCounts(await dep.calls())).toEqual({
      'saved-1': [2],
      'restart-1': [2],
      'saved-1-a1': [2, 4],
      'restart-1-a1': [2, 4],
    });
    expect(await dep.trackedAfterForget(['saved-1', 'restart-1'])).toEqual({});
  },
);

scenario('without a crash the restart runs through the checkpoint and finishes', async () => {
  const dep = await Deployment.start('mixed');
  const { saved, restart } = await checkpointBoth(dep);
  await dep.resume('c1');
  await dep.backend('/_ctl/release', {});
  const [savedReply, restartReply] = await Promise.all([saved.reply, restart.reply]);
  expect(savedReply.body.result).toMatchObject({ reward: 1 });
  expect(restartReply.body.result).toMatchObject({ reward: 1 });
  expect(restartReply.body.episode_id).toEqual({ rollout_id: 'restart-1', attempt: 0 });
  expect(await dep.callCount()).toBe(4);
  expect(tracked(await dep.statuses())).toEqual({});
});
