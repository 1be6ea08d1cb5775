/**
 * An in-flight generation is cut at prepare and its prefix continued after the restore (native
 * stack, token capture and generation cuts on).
 */
import { ep } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { weatherEpisode } from './support/stacks.js';

afterEach(closeAll);

scenario('an in-flight generation is cut and its prefix continued after the restore', async () => {
  const dep = await Deployment.start('native', { tokenCapture: true, generationCuts: true });
  // The second call generates a few tokens of its answer, then waits: mid-generation.
  await dep.backend('/_ctl/hold', { after_calls: 1, after_tokens: 3 });
  dep.post('env', '/run', weatherEpisode('cut-1'));
  await dep.waitForCalls(2);
  await dep.checkpoint('c1', [ep('cut-1')]);

  const calls = await dep.calls();
  const cutCall = (calls[1]?.admission as { model_call_id?: string } | null)?.model_call_id;
  expect(typeof cutCall).toBe('string');
  expect((await dep.backend<{ cuts: string[][] }>('/_ctl/cuts')).cuts).toEqual([[cutCall]]);

  await dep.crashAndRestore('c1', [ep('cut-1')]);
  const reply = await dep.post('env', '/run', weatherEpisode('cut-1', 1)).reply;
  expect(reply.status).toBe(200);
  expect(reply.body.result).toMatchObject({ reward: 1 });
  const replacement = (await dep.calls()).filter((c) => c.capture_key === 'cut-1-a1');
  expect(replacement.map((c) => c.continued_from)).toEqual([cutCall]);
  expect(await dep.trackedAfterForget(['cut-1'])).toEqual({});
});
