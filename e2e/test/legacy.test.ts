/**
 * The legacy entries continue from their protocol boundary after a crash: Simple Agent's
 * whole-episode `/run`, and a flat row sent to the environment's `single_agent_turn_legacy`.
 */
import { ep } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { weatherRow } from './support/stacks.js';

afterEach(closeAll);

scenario('a legacy /run episode continues from its last boundary after a crash', async () => {
  const dep = await Deployment.start('legacy');
  await dep.backend('/_ctl/hold', { after_calls: 1 });
  const first = dep.post('simple_agent', '/run', weatherRow('legacy-1'));
  await dep.waitForCalls(2);
  const { committed } = await dep.checkpoint('c1', [ep('legacy-1')]);
  expect(committed.simple_agent?.episode_ids).toEqual(['legacy-1']);

  const restored = await dep.crashAndRestore('c1', [ep('legacy-1')]);
  expect(restored.simple_agent?.restored).toEqual(['legacy-1-a1']);
  await expect(first.reply).rejects.toThrow();

  const reply = await dep.post('simple_agent', '/run', weatherRow('legacy-1', 1)).reply;
  expect(reply.status).toBe(200);
  expect(reply.body).toMatchObject({ reward: 1 });
  expect(await dep.messageCounts()).toEqual([1, 3, 3]);
  expect(await dep.trackedAfterForget(['legacy-1'])).toEqual({});
});

scenario('a flat row through the environment legacy adapter continues after a crash', async () => {
  const dep = await Deployment.start('legacy');
  await dep.backend('/_ctl/hold', { after_calls: 1 });
  const row = (attempt: number) => ({ ...weatherRow('flat-1', attempt), task_id: 'weather-sf' });
  const first = dep.post('legacy_env', '/run', row(0));
  await dep.waitForCalls(2);
  const { committed } = await dep.checkpoint('c1', [ep('flat-1')]);
  expect(committed.legacy_env?.episode_ids).toEqual(['flat-1']);
  expect(committed.simple_agent?.episode_ids).toEqual(['flat-1']);

  const restored = await dep.crashAndRestore('c1', [ep('flat-1')]);
  expect(restored.legacy_env?.restored).toEqual(['flat-1-a1']);
  await expect(first.reply).rejects.toThrow();

  const reply = await dep.post('legacy_env', '/run', row(1)).reply;
  expect(reply.status).toBe(200);
  // The adapter answers a flat row with the verify result itself.
  expect(reply.body).toMatchObject({ reward: 1 });
  expect(await dep.messageCounts()).toEqual([1, 3, 3]);
  expect(await dep.trackedAfterForget(['flat-1'])).toEqual({});
});
