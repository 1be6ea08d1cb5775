/**
 * A policy model server with two workers (`num_workers: 2`) is one participant: rollouts in
 * flight on both workers are checkpointed, crashed (every process group SIGKILLed, workers
 * included) and restored into fresh processes; a worker SIGKILLed during a checkpoint blocks it,
 * and once the server is restarted the next checkpoint commits.
 */
import { existsSync } from 'node:fs';
import { join } from 'node:path';

import { commit, CoordinationError, forget, prepare } from '@ckpt-gym/core/client';
import { deadline, ep, tracked, until } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { childPids } from './support/processes.js';
import { replacementsContinue } from './support/replacements.js';
import { weatherEpisode } from './support/stacks.js';

afterEach(closeAll);

const WORKERS = 2;

interface WorkerView {
  index: number;
  pid: number;
  ready: boolean;
  inflight?: number;
  held?: number;
}

async function policyWorkers(dep: Deployment): Promise<WorkerView[]> {
  return (await dep.status('policy')).workers as WorkerView[];
}

/**
 * What every server tracks, once `rollouts` are forgotten: nothing, as with one process (the
 * coordinator's counts are its workers' counts summed; the workers are in its status).
 */
async function trackedAfterForget(dep: Deployment, rollouts: readonly string[]) {
  await forget(dep.participants(), `forget-${rollouts.length}`, rollouts, deadline(30));
  return tracked(await dep.statuses());
}

scenario(
  'rollouts in flight on both workers are checkpointed, crashed and continued after the restore',
  async () => {
    const dep = await Deployment.start('native', { policyWorkers: WORKERS, tokenCapture: true });
    const primary = dep.server('policy').pid;
    expect(await childPids(primary)).toHaveLength(WORKERS);
    const rollouts = Array.from({ length: 8 }, (_, i) => `two-${i}`);
    await dep.startHeldAtSecondCall(rollouts, (r) => weatherEpisode(r));

    const { prepared, committed } = await dep.checkpoint(
      'c1',
      rollouts.map((r) => ep(r)),
    );
    expect(prepared.restarts()).toEqual([]);
    expect(committed.env?.episode_ids).toEqual([...rollouts].sort());
    expect(committed.policy?.episode_ids).toEqual([...rollouts].sort());
    // Both workers hold calls of this checkpoint (each worker's gate reports its own).
    const workers = await policyWorkers(dep);
    expect(workers.map((w) => w.pid).sort()).toEqual(await childPids(primary));
    for (const worker of workers) expect(worker.inflight).toBeGreaterThan(0);
    expect(workers.reduce((sum, w) => sum + (w.inflight ?? 0), 0)).toBe(rollouts.length);

    const restored = await dep.crashAndRestore(
      'c1',
      rollouts.map((r) => ep(r)),
    );
    expect(restored.env?.restored).toEqual(rollouts.map((r) => `${r}-a1`).sort());
    expect(await childPids(dep.server('policy').pid)).toHaveLength(WORKERS);

    await replacementsContinue(dep, rollouts);
    expect(await trackedAfterForget(dep, rollouts)).toEqual({});
  },
  240_000,
);

/** The policy model's failure of a commit that must fail. */
async function failedCommit(dep: Deployment, id: string, rollouts: readonly string[]) {
  const participants = dep.participants();
  const scope = rollouts.map((r) => ep(r));
  const err = await commit(participants, id, dep.checkpointDir(id), scope, deadline(30)).then(
    () => undefined,
    (e: unknown) => e as CoordinationError,
  );
  expect(err).toBeInstanceOf(CoordinationError);
  return err!.failures.policy;
}

scenario(
  'a worker SIGKILLed during prepare blocks that checkpoint; after a restart the next one commits',
  async () => {
    const dep = await Deployment.start('native', { policyWorkers: WORKERS, tokenCapture: true });
    const rollouts = ['lost-0', 'lost-1', 'lost-2', 'lost-3'];
    await dep.startHeldAtSecondCall(rollouts, (r) => weatherEpisode(r));

    const prepared = await prepare(dep.participants(), 'c1', deadline(30));
    expect(prepared.prepared).toBe(true);
    const [victim] = await childPids(dep.server('policy').pid);
    process.kill(victim!, 'SIGKILL');
    // What the lost worker held is unknown: the checkpoint is blocked, not weakened.
    // (A pooled connection to the dead worker is reset: the status is asked again.)
    await until(
      async () =>
        !(await policyWorkers(dep).catch(() => [{ pid: victim }])).some((w) => w.pid === victim),
      'the coordinator to see the worker gone',
      30_000,
    );
    const report = (await dep.status('policy')).report;
    expect(report.blocker_count).toBeGreaterThan(0);
    expect(report.blockers).toContain('policy-worker-lost');
    // Its commit fails, and so does a retried one: the failure is final for the checkpoint.
    expect(await failedCommit(dep, 'c1', rollouts)).toMatch(/export_failed/);
    expect(await failedCommit(dep, 'c1', rollouts)).toMatch(/export_failed/);
    expect(existsSync(join(dep.checkpointDir('c1'), 'model', 'policy', 'manifest.json'))).toBe(
      false,
    );

    // The server restarts (with every gym process): its workers are fresh and the next
    // checkpoint, with new rollouts in flight, commits.
    await dep.crash();
    await dep.backend('/_ctl/release', {});
    await dep.restart();
    expect(await childPids(dep.server('policy').pid)).toHaveLength(WORKERS);
    const next = ['next-0', 'next-1'];
    // The release ended the hold: each new rollout's second call is held again.
    await dep.startHeldAtSecondCall(next, (r) => weatherEpisode(r));
    const { committed } = await dep.checkpoint(
      'c2',
      next.map((r) => ep(r)),
    );
    expect(committed.policy?.episode_ids).toEqual(next);
    expect(committed.env?.episode_ids).toEqual(next);
    await dep.records('c2', 'model', 'policy');
  },
  240_000,
);

scenario(
  'with two workers, an in-flight generation is cut and its prefix continued after the restore',
  async () => {
    const dep = await Deployment.start('native', {
      policyWorkers: WORKERS,
      tokenCapture: true,
      generationCuts: true,
    });
    // The second call generates a few tokens of its answer, then waits: mid-generation.
    await dep.backend('/_ctl/hold', { after_calls: 1, after_tokens: 3 });
    dep.post('env', '/run', weatherEpisode('cut-1'));
    await dep.waitForCalls(2);
    await dep.checkpoint('c1', [ep('cut-1')]);
    const cutCall = ((await dep.calls())[1]?.admission as { model_call_id?: string } | null)
      ?.model_call_id;
    expect((await dep.backend<{ cuts: string[][] }>('/_ctl/cuts')).cuts).toEqual([[cutCall]]);

    // The coordinator holds the restored cut; the worker the replacement lands on claims it.
    await dep.crashAndRestore('c1', [ep('cut-1')]);
    expect((await dep.status('policy')).restored_generation_cuts).toEqual(['cut-1-a1']);
    const reply = await dep.post('env', '/run', weatherEpisode('cut-1', 1)).reply;
    expect(reply.status).toBe(200);
    expect(reply.body.result).toMatchObject({ reward: 1 });
    const replacement = (await dep.calls()).filter((c) => c.capture_key === 'cut-1-a1');
    expect(replacement.map((c) => c.continued_from)).toEqual([cutCall]);
    expect((await dep.status('policy')).restored_generation_cuts).toEqual([]);
  },
  240_000,
);
