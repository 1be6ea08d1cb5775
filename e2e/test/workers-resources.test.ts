/**
 * A counter resources server with two workers (`num_workers: 2`) is one participant, and each
 * session's requests reach the worker that owns it: sessions seeded on both workers are
 * checkpointed with rollouts in flight, every process group is SIGKILLed, and after the restore
 * into fresh processes every rollout continues with its session's counter (the reward needs it).
 * A cookie naming a worker that no longer exists reaches the session's new owner from whichever
 * worker its connection lands on.
 */
import { request } from 'node:http';

import { ep } from '@ckpt-gym/testing';
import { SessionCookie, sessionSecret } from '@ckpt-gym/resources-server';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { childPids } from './support/processes.js';
import { counterEpisode, TOKEN } from './support/stacks.js';

afterEach(closeAll);

const WORKERS = 2;
const RESOURCES = 'counter';

/** The counter of `sessionId` read over a fresh connection, with a cookie naming `owner`. */
function counterVia(
  dep: Deployment,
  cookie: SessionCookie,
  session: { id: string; owner: string; attempt: string },
): Promise<{ status: number; body: { count?: number } }> {
  const url = new URL(`/ng-rollout/${session.attempt}/get_counter_value`, dep.url(RESOURCES));
  return new Promise((resolve, reject) => {
    const req = request(
      url,
      {
        method: 'POST',
        // A connection of its own: cluster hands each to the next worker in turn.
        agent: false,
        headers: {
          'content-type': 'application/json',
          cookie: cookie.header(session.id).split(';')[0]!,
        },
      },
      (res) => {
        let text = '';
        res.setEncoding('utf8');
        res.on('data', (chunk: string) => (text += chunk));
        res.on('end', () => resolve({ status: res.statusCode!, body: JSON.parse(text) }));
      },
    );
    req.on('error', reject);
    req.end('{}');
  });
}

scenario(
  'sessions on both resources workers are checkpointed, crashed and continued; an old owner is aliased',
  async () => {
    const dep = await Deployment.start('counter', { resourcesWorkers: WORKERS });
    expect(await childPids(dep.server(RESOURCES).pid)).toHaveLength(WORKERS);
    // Every rollout's second model call is held: its counter is at 4 (3, then +1).
    const rollouts = Array.from({ length: 6 }, (_, i) => `count-${i}`);
    await dep.startHeldAtSecondCall(rollouts, (r) => counterEpisode(r));

    const { committed } = await dep.checkpoint(
      'c1',
      rollouts.map((r) => ep(r)),
    );
    expect(committed[RESOURCES]?.episode_ids).toEqual([...rollouts].sort());
    const records = await dep.records('c1', 'resources', RESOURCES);
    expect(records).toHaveLength(rollouts.length);
    const owners = new Set(records.map((r) => r.owner as string));
    // The sessions were seeded on both workers.
    expect(owners.size).toBe(WORKERS);

    await dep.crashAndRestore(
      'c1',
      rollouts.map((r) => ep(r)),
    );
    expect(await childPids(dep.server(RESOURCES).pid)).toHaveLength(WORKERS);
    const status = await dep.status(RESOURCES);
    expect(status.session_aliases).toBe(WORKERS);

    // Each cookie names a pre-crash worker: over fresh connections (both workers in turn), every
    // read reaches the worker that holds the session now, and finds its restored counter.
    const secret = sessionSecret({ controlAuthToken: TOKEN, serverName: RESOURCES });
    for (const record of records) {
      const owner = record.owner as string;
      const cookie = new SessionCookie(RESOURCES, secret, owner);
      const rollout = (record.episode_id as { rollout_id: string }).rollout_id;
      const session = { id: record.session_id as string, owner, attempt: `${rollout}-a1` };
      for (let i = 0; i < WORKERS; i += 1) {
        expect(await counterVia(dep, cookie, session)).toEqual({ status: 200, body: { count: 4 } });
      }
    }

    const replies = await Promise.all(
      rollouts.map((r) => dep.post('env', '/run', counterEpisode(r, 1)).reply),
    );
    for (const reply of replies) {
      expect(reply.status).toBe(200);
      expect(reply.body.failure).toBeNull();
      expect(reply.body.result).toMatchObject({ reward: 1, count: 6 });
    }
    expect(await dep.trackedAfterForget(rollouts)).toEqual({});
  },
  240_000,
);
