/**
 * The counter example keeps state on the resources server (`exported` mode): the right reward
 * needs the counter restored with the episode. The negative control skips the resources restore.
 */
import { ep } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { counterEpisode } from './support/stacks.js';

afterEach(closeAll);

/** Holds the second model call (after `+1` ran: the counter is 4), checkpoints, crashes, restores. */
async function crashAfterFirstIncrement(dep: Deployment, skipKinds: string[]) {
  await dep.backend('/_ctl/hold', { after_calls: 1 });
  dep.post('env', '/run', counterEpisode('counter-1'));
  await dep.waitForCalls(2);
  const { committed } = await dep.checkpoint('c1', [ep('counter-1')]);
  expect(committed.counter?.episode_ids).toEqual(['counter-1']);
  await dep.crashAndRestore('c1', [ep('counter-1')], { skipKinds });
  return dep.post('env', '/run', counterEpisode('counter-1', 1)).reply;
}

scenario('restored counter state gives the right reward', async () => {
  const dep = await Deployment.start('counter');
  const reply = await crashAfterFirstIncrement(dep, []);
  expect(reply.status).toBe(200);
  expect(reply.body.failure).toBeNull();
  expect(reply.body.result).toMatchObject({ reward: 1, count: 6 });
  // +1 delivered before the crash; the replacement repeats only the undelivered call, then answers.
  expect(await dep.messageCounts()).toEqual([1, 3, 3, 5]);
  expect(await dep.trackedAfterForget(['counter-1'])).toEqual({});
});

scenario('negative control: without the resources restore the counter cannot reach 6', async () => {
  const dep = await Deployment.start('counter');
  const reply = await crashAfterFirstIncrement(dep, ['resources']);
  const reward = (reply.body.result as { reward?: number } | null | undefined)?.reward;
  expect(reply.status !== 200 || reward !== 1).toBe(true);
});
