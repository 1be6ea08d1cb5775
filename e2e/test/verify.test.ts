/**
 * Verification in flight at a checkpoint (the slow-verify server blocks `/verify` while its flag
 * file exists): replayed after a restore in `replay` mode, waited for in `wait` mode; and an
 * episode that finishes during prepare is neither lost nor redone.
 */
import { existsSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';

import { commit, prepare, type PrepareResult } from '@ckpt-gym/core/client';
import { deadline, ep, until } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { SLOW_VERIFY_FLAG, SLOW_VERIFY_LOG, weatherEpisode } from './support/stacks.js';

afterEach(closeAll);

function verifications(dep: Deployment): number {
  const path = join(dep.runDir, SLOW_VERIFY_LOG);
  return existsSync(path) ? readFileSync(path, 'utf8').split('\n').filter(Boolean).length : 0;
}

const flag = (dep: Deployment) => join(dep.runDir, SLOW_VERIFY_FLAG);

/** Starts `rollout` with the flag set and waits until its `/verify` is blocked on the flag. */
async function verifyInFlight(dep: Deployment, rollout: string) {
  writeFileSync(flag(dep), '');
  const run = dep.post('env', '/run', weatherEpisode(rollout));
  await dep.waitForCalls(2);
  await until(
    async () => (await dep.calls()).every((c) => c.returned),
    'both model calls answered',
    30_000,
  );
  // The agent session is closed right before the verify boundary; the verify counts in flight
  // on the resources server in wait mode, and has been sent soon after in replay mode.
  await until(
    async () => (await dep.status('simple_agent')).report.counts?.sessions === 0,
    'the agent to close',
    30_000,
  );
  await new Promise((r) => setTimeout(r, 500));
  return run;
}

async function envBoundary(dep: Deployment, id: string): Promise<Record<string, unknown>> {
  const [record] = await dep.records(id, 'environment', 'env');
  return (record?.boundary ?? {}) as Record<string, unknown>;
}

for (const mode of ['replay', 'wait'] as const) {
  scenario(
    `verification in flight is ${mode === 'replay' ? 'replayed' : 'waited for'} (checkpoint_verify: ${mode})`,
    async () => {
      const dep = await Deployment.start('slow', { checkpointVerify: mode });
      await verifyInFlight(dep, 'verify-1');

      const early: PrepareResult = await prepare(dep.participants(), 'c1', deadline(1));
      if (mode === 'replay') {
        expect(early.prepared).toBe(true);
      } else {
        expect(early.prepared).toBe(false);
        expect(early.blockers()).toEqual({ env: ['verify-1'] });
        rmSync(flag(dep));
      }
      const { committed } = await dep.checkpoint('c1', [ep('verify-1')]);
      expect(committed.env?.episode_ids).toEqual(['verify-1']);
      expect((await envBoundary(dep, 'c1')).next).toBe(mode === 'replay' ? 'verify' : 'return');
      const before = verifications(dep);
      expect(before).toBe(mode === 'replay' ? 0 : 1);

      await dep.crashAndRestore('c1', [ep('verify-1')], {
        beforeRestart: async () => rmSync(flag(dep), { force: true }),
      });
      const reply = await dep.post('env', '/run', weatherEpisode('verify-1', 1)).reply;
      expect(reply.status).toBe(200);
      expect(reply.body.result).toMatchObject({ reward: 1 });
      expect(await dep.callCount()).toBe(2);
      // Replay: the verification runs again; wait: its result was restored, not re-run.
      expect(verifications(dep) - before).toBe(mode === 'replay' ? 1 : 0);
      expect(await dep.trackedAfterForget(['verify-1'])).toEqual({});
    },
  );
}

for (const crash of [false, true]) {
  scenario(
    `an episode that finishes during prepare is neither lost nor redone (${crash ? 'with' : 'without'} a crash)`,
    async () => {
      const dep = await Deployment.start('slow', { checkpointVerify: 'wait' });
      const run = await verifyInFlight(dep, 'done-1');
      const participants = dep.participants();
      const preparing = prepare(participants, 'c1', deadline(30));
      await until(
        async () => (await dep.status('env')).phase === 'preparing',
        'prepare to start',
        30_000,
      );
      rmSync(flag(dep));
      const prepared = await preparing;
      expect(prepared.prepared).toBe(true);
      await new Promise((r) => setTimeout(r, 500));
      // Finished its verification, but its reply waits for the checkpoint: nothing is delivered.
      expect(run.done()).toBe(false);
      const committed = await commit(
        participants,
        'c1',
        dep.checkpointDir('c1'),
        [ep('done-1')],
        deadline(30),
      );
      expect(committed.env?.episode_ids).toEqual(['done-1']);
      expect((await envBoundary(dep, 'c1')).next).toBe('return');

      let reply;
      if (crash) {
        await dep.crashAndRestore('c1', [ep('done-1')]);
        reply = await dep.post('env', '/run', weatherEpisode('done-1', 1)).reply;
      } else {
        await dep.resume('c1');
        reply = await run.reply;
      }
      expect(reply.status).toBe(200);
      expect(reply.body.result).toMatchObject({ reward: 1 });
      expect(await dep.callCount()).toBe(2);
      expect(verifications(dep)).toBe(1);
      expect(await dep.trackedAfterForget(['done-1'])).toEqual({});
    },
  );
}
