/**
 * Simple Agent with two workers (`num_workers: 2`) is one participant, and each native session's
 * requests reach the worker that owns it: sessions seeded on both workers are checkpointed with
 * rollouts in flight, every process group is SIGKILLed, and after the restore into fresh
 * processes every rollout continues once with reward 1. A cookie naming a worker that no longer
 * exists reaches the session's new owner from whichever worker its connection lands on. A
 * restored legacy `/run` is claimed by exactly one of two concurrent replacement `/run` calls.
 */
import { request } from 'node:http';

import { SessionCookieSigner } from '@ckpt-gym/agent-server';
import { ep } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { childPids } from './support/processes.js';
import { replacementsContinue } from './support/replacements.js';
import { weatherEpisode, weatherRow } from './support/stacks.js';

afterEach(closeAll);

const WORKERS = 2;
const AGENT = 'simple_agent';

/**
 * A `/v1/responses` call on the session under an attempt that does not own it, over a fresh
 * connection (cluster hands each to the next worker in turn): its owner refuses it as
 * `stale_attempt` without touching it; a worker that does not hold the session would answer
 * `checkpoint_error` (unknown session).
 */
function probe(
  dep: Deployment,
  cookie: string,
  attempt: string,
): Promise<{ status: number; code: string | undefined }> {
  const url = new URL(`/ng-rollout/${attempt}/v1/responses`, dep.url(AGENT));
  return new Promise((resolve, reject) => {
    const req = request(
      url,
      {
        method: 'POST',
        agent: false,
        headers: { 'content-type': 'application/json', cookie: `agent_session_id=${cookie}` },
      },
      (res) => {
        let text = '';
        res.setEncoding('utf8');
        res.on('data', (chunk: string) => (text += chunk));
        res.on('end', () => {
          const body = JSON.parse(text) as { error?: { code?: string } };
          resolve({ status: res.statusCode!, code: body.error?.code });
        });
      },
    );
    req.on('error', reject);
    req.end(JSON.stringify({ input: 'probe' }));
  });
}

scenario(
  'sessions on both agent workers are checkpointed, crashed and each continued once; an old owner is aliased',
  async () => {
    const dep = await Deployment.start('native', { agentWorkers: WORKERS, tokenCapture: true });
    expect(await childPids(dep.server(AGENT).pid)).toHaveLength(WORKERS);
    const rollouts = Array.from({ length: 6 }, (_, i) => `agentw-${i}`);
    await dep.startHeldAtSecondCall(rollouts, (r) => weatherEpisode(r));

    const { committed } = await dep.checkpoint(
      'c1',
      rollouts.map((r) => ep(r)),
    );
    expect(committed[AGENT]?.episode_ids).toEqual([...rollouts].sort());
    const records = await dep.records('c1', 'agent', AGENT);
    expect(records).toHaveLength(rollouts.length);
    // The sessions were seeded on both workers.
    expect(new Set(records.map((r) => r.owner as string)).size).toBe(WORKERS);

    await dep.crashAndRestore(
      'c1',
      rollouts.map((r) => ep(r)),
    );
    expect(await childPids(dep.server(AGENT).pid)).toHaveLength(WORKERS);
    expect((await dep.status(AGENT)).session_aliases).toBe(WORKERS);

    // Each cookie names a pre-crash worker: over fresh connections (both workers in turn), every
    // call reaches the worker that holds the session now.
    for (const record of records) {
      const signer = new SessionCookieSigner(`ckpt-gym-agent___${AGENT}`, record.owner as string);
      const rollout = (record.episode_id as { rollout_id: string }).rollout_id;
      const cookie = signer.sign(record.session_key as string);
      for (let i = 0; i < WORKERS; i += 1) {
        expect(await probe(dep, cookie, `${rollout}-a2`)).toEqual({
          status: 409,
          code: 'stale_attempt',
        });
      }
    }

    await replacementsContinue(dep, rollouts);
    expect(await dep.trackedAfterForget(rollouts)).toEqual({});
  },
  240_000,
);

scenario(
  'two replacement legacy /run calls for one restored episode at once: one claims and runs, the other is refused',
  async () => {
    const dep = await Deployment.start('legacy', { agentWorkers: WORKERS });
    await dep.backend('/_ctl/hold', { after_calls: 1 });
    const first = dep.post(AGENT, '/run', weatherRow('twice'));
    await dep.waitForCalls(2);
    const { committed } = await dep.checkpoint('c1', [ep('twice')]);
    expect(committed[AGENT]?.episode_ids).toEqual(['twice']);
    await dep.crashAndRestore('c1', [ep('twice')]);
    await first.reply.catch(() => undefined);

    const replies = await Promise.all([
      dep.post(AGENT, '/run', weatherRow('twice', 1)).reply,
      dep.post(AGENT, '/run', weatherRow('twice', 1)).reply,
    ]);
    const [ran, refused] = [...replies].sort((a, b) => a.status - b.status);
    expect([ran?.status, ran?.body.reward]).toEqual([200, 1]);
    expect([refused?.status, (refused?.body.error as { code?: string }).code]).toEqual([
      409,
      'checkpoint_error',
    ]);
  },
  240_000,
);
