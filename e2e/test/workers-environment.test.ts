/**
 * An environment server with two workers (`num_workers: 2`) is one participant: episodes in flight
 * on both workers are checkpointed, crashed (every process group SIGKILLed, workers included) and
 * restored into fresh processes, where the coordinator holds each restored episode until the
 * worker that receives its replacement `/run` claims it; a second replacement for the same
 * episode at the same time is refused.
 */
import { forget } from '@ckpt-gym/core/client';
import { deadline, ep, tracked } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { childPids } from './support/processes.js';
import { replacementsContinue } from './support/replacements.js';
import { weatherEpisode } from './support/stacks.js';

afterEach(closeAll);

const WORKERS = 2;

interface WorkerView {
  index: number;
  pid: number;
  counts?: { episodes?: number };
}

/** Starts `rollouts` and waits until each is between its two model calls (the second is held). */
async function inFlight(rollouts: readonly string[]): Promise<Deployment> {
  const dep = await Deployment.start('native', { envWorkers: WORKERS, tokenCapture: true });
  expect(await childPids(dep.server('env').pid)).toHaveLength(WORKERS);
  await dep.startHeldAtSecondCall(rollouts, (r) => weatherEpisode(r));
  return dep;
}

scenario(
  'episodes in flight on both environment workers are checkpointed, crashed and each continued once',
  async () => {
    const rollouts = Array.from({ length: 6 }, (_, i) => `envw-${i}`);
    const dep = await inFlight(rollouts);
    const { committed } = await dep.checkpoint(
      'c1',
      rollouts.map((r) => ep(r)),
    );
    expect(committed.env?.episode_ids).toEqual([...rollouts].sort());
    // Both workers run episodes of this checkpoint; together, every one.
    const workers = (await dep.status('env')).workers as WorkerView[];
    expect(workers.map((w) => w.pid).sort()).toEqual(await childPids(dep.server('env').pid));
    for (const worker of workers) expect(worker.counts?.episodes).toBeGreaterThan(0);
    expect(workers.reduce((sum, w) => sum + (w.counts?.episodes ?? 0), 0)).toBe(rollouts.length);

    const restored = await dep.crashAndRestore(
      'c1',
      rollouts.map((r) => ep(r)),
    );
    expect(restored.env?.restored).toEqual(rollouts.map((r) => `${r}-a1`).sort());
    expect((await dep.status('env')).restored_pending).toEqual(
      rollouts.map((r) => `${r}-a1`).sort(),
    );

    await replacementsContinue(dep, rollouts);
    await forget(dep.participants(), 'forget-envw', rollouts, deadline(30));
    expect(tracked(await dep.statuses())).toEqual({});
  },
  240_000,
);

scenario(
  'two replacement /run calls for one restored episode at once: one claims and runs, the other is refused',
  async () => {
    const dep = await inFlight(['twice']);
    await dep.checkpoint('c1', [ep('twice')]);
    await dep.crashAndRestore('c1', [ep('twice')]);

    const replies = await Promise.all([
      dep.post('env', '/run', weatherEpisode('twice', 1)).reply,
      dep.post('env', '/run', weatherEpisode('twice', 1)).reply,
    ]);
    const [ran, refused] = [...replies].sort((a, b) => a.status - b.status);
    expect(ran?.status).toBe(200);
    expect(ran?.body.result).toMatchObject({ reward: 1 });
    expect(refused?.status).toBe(409);
    expect(refused?.body).toMatchObject({ error: { code: 'checkpoint_error' } });
    // The episode ran once, from its boundary.
    const calls = (await dep.calls()).filter((c) => c.capture_key === 'twice-a1');
    expect(calls.map((c) => c.n_messages)).toEqual([4]);
    expect((await dep.status('env')).restored_pending).toEqual([]);
  },
  240_000,
);
