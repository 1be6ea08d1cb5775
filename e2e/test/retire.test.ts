/**
 * Retiring an episode mid-flight stops it on every server and leaves only the marks refusing the
 * retired attempt, until `forget` clears them.
 */
import { forget, retire } from '@ckpt-gym/core/client';
import { deadline, ep, tracked } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { TOKEN, weatherEpisode } from './support/stacks.js';

afterEach(closeAll);

scenario(
  'an episode retired mid-flight stops everywhere and forget clears every mark',
  async () => {
    const dep = await Deployment.start('native', { tokenCapture: true });
    await dep.backend('/_ctl/hold', { after_calls: 1 });
    const run = dep.post('env', '/run', weatherEpisode('gone-1'));
    await dep.waitForCalls(2);

    const participants = dep.participants();
    await retire(participants, 'retire-1', [ep('gone-1')], deadline(30));
    const reply = await run.reply;
    expect(reply.status).toBe(409);
    expect(reply.body).toMatchObject({ error: { code: 'stale_attempt' } });

    // Released calls of the retired attempt go nowhere; the model makes no further call for it.
    await dep.backend('/_ctl/release', {});
    await new Promise((r) => setTimeout(r, 1000));
    expect(await dep.callCount()).toBe(2);

    // Nothing is tracked for it anywhere, except the mark refusing the retired attempt.
    expect(tracked(await dep.statuses())).toEqual({
      env: { retired_rollouts: 1 },
      simple_agent: { retired_rollouts: 1 },
      weather: { retired_rollouts: 1 },
      policy: { retired_rollouts: 1 },
    });
    // Its capture ledger is retired.
    const manifest = await dep.clients.data(
      `${dep.url('policy')}/training-token-capture/control/rollouts/gone-1/manifest`,
      {
        headers: { authorization: `Bearer ${TOKEN}` },
        throwHttpErrors: false,
        retry: { limit: 0 },
      },
    );
    expect(manifest.statusCode).toBe(410);
    expect(manifest.body).toContain('retired');

    // A duplicate /run of the retired attempt (a client retry) is refused, not run again.
    const duplicate = await dep.post('env', '/run', weatherEpisode('gone-1')).reply;
    expect(duplicate.status).toBe(409);
    expect(duplicate.body).toMatchObject({ error: { code: 'stale_attempt' } });
    expect(await dep.callCount()).toBe(2);

    await forget(participants, 'forget-1', ['gone-1'], deadline(30));
    expect(tracked(await dep.statuses())).toEqual({});
  },
);
