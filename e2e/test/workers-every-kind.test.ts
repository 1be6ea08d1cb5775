/**
 * A stack with two workers of every server kind (policy model, resources, agent, environment):
 * rollouts in flight on both workers of each are checkpointed, every process group is SIGKILLed,
 * and after the restore into fresh processes every rollout continues once with reward 1.
 */
import { ep } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { childPids } from './support/processes.js';
import { replacementsContinue } from './support/replacements.js';
import { weatherEpisode } from './support/stacks.js';

afterEach(closeAll);

const WORKERS = 2;
const SERVERS = ['policy', 'weather', 'simple_agent', 'env'] as const;

interface WorkerView {
  counts?: Record<string, number>;
}

scenario(
  'rollouts in flight on both workers of every kind are checkpointed, crashed and each continued once',
  async () => {
    const dep = await Deployment.start('native', {
      policyWorkers: WORKERS,
      resourcesWorkers: WORKERS,
      agentWorkers: WORKERS,
      envWorkers: WORKERS,
      tokenCapture: true,
    });
    for (const name of SERVERS) expect(await childPids(dep.server(name).pid)).toHaveLength(WORKERS);
    const rollouts = Array.from({ length: 8 }, (_, i) => `every-${i}`);
    await dep.startHeldAtSecondCall(rollouts, (r) => weatherEpisode(r));

    const { committed } = await dep.checkpoint(
      'c1',
      rollouts.map((r) => ep(r)),
    );
    for (const name of ['simple_agent', 'env']) {
      expect(committed[name]?.episode_ids).toEqual([...rollouts].sort());
    }
    // The episodes run on both environment workers, the agent sessions live on both agent workers
    // (their records name both owners); the weather server is stateless (it exports nothing).
    const envWorkers = (await dep.status('env')).workers as WorkerView[];
    for (const worker of envWorkers) expect(worker.counts?.episodes).toBeGreaterThan(0);
    const owners = new Set((await dep.records('c1', 'agent', 'simple_agent')).map((r) => r.owner));
    expect(owners.size).toBe(WORKERS);

    await dep.crashAndRestore(
      'c1',
      rollouts.map((r) => ep(r)),
    );
    for (const name of SERVERS) expect(await childPids(dep.server(name).pid)).toHaveLength(WORKERS);
    // Every pre-crash owner of both session kinds is aliased to a live worker.
    for (const name of ['simple_agent', 'weather']) {
      expect((await dep.status(name)).session_aliases).toBe(WORKERS);
    }

    await replacementsContinue(dep, rollouts);
    expect(await dep.trackedAfterForget(rollouts)).toEqual({});
  },
  300_000,
);
