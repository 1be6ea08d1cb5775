/**
 * `run --resume`: the next leg of the run `--output` and `--checkpoint-dir` name. Its log is
 * started before anything is retired, restored or sent; the rows the previous leg may have sent
 * are retired everywhere before they start over; the previous leg's checkpoint is restored, and
 * if that fails its rows start over from their input instead (collection/resume.ts).
 */
import { type Participants, resume, retire } from '@ckpt-gym/core/client';
import { captureKey, type EpisodeId } from '@ckpt-gym/core/protocol';

import type { InputTask } from '../collect.js';
import type { CollectionDir } from '../collection/files.js';
import type { Outputs } from '../collection/outputs.js';
import { planResume, type ResumePlan, restartAfterFailedRestore } from '../collection/resume.js';
import { CliFailure, type CommandContext, describe, generatedId } from '../context.js';
import { subContext } from './common.js';
import { restoreCommand } from './restore.js';
import { dispatchOf, type Leg, runTasksOf } from './run-leg.js';

export async function resumeLeg(
  ctx: CommandContext,
  dir: CollectionDir,
  tasks: readonly InputTask[],
  outputs: Outputs,
): Promise<Leg> {
  const log = dir.readLog();
  if (log === undefined) {
    throw new CliFailure(`nothing to resume in ${dir.root}: no run wrote a dispatch log there`);
  }
  const { finished, runs } = outputs.read();
  const others = [...runs].filter((run) => run !== log.run_id);
  if (others.length > 0) {
    throw new CliFailure(
      `${outputs.path} holds rows of run ${others.join(', ')}, but ${dir.root} is run ` +
        `${log.run_id}'s: give the --output and --checkpoint-dir of one run`,
    );
  }
  const head = { run_id: log.run_id, leg: log.leg + 1 };
  const byId = runTasksOf(head.run_id, tasks);
  const unfinished = [...byId.keys()].filter((id) => !finished.has(id));
  const latest = readLatest(dir);
  const plan = planResume(unfinished, log, latest?.manifest);
  await dir.startLog(head, plan.carried);
  const participants = await ctx.participants();
  if (plan.fenced.length > 0) await retireOrFail(ctx, participants, plan.fenced);
  const sendAs = await restoreOrRestart(ctx, participants, latest?.dir, plan);
  ctx.progress(
    `resume run ${head.run_id} (leg ${head.leg})` +
      `${latest ? ` from ${latest.dir}` : ' (no checkpoint)'}: ${sendAs.restored} continued, ` +
      `${plan.fenced.length + sendAs.fallback} restarted, ` +
      `${unfinished.length - plan.fenced.length - plan.continued.length} not started, ` +
      `${byId.size - unfinished.length} finished` +
      (plan.stale === undefined ? '' : `; its checkpoint is not restored: ${plan.stale}`),
  );
  return {
    head,
    dispatches: unfinished.map((id) => dispatchOf(id, sendAs.attempts.get(id) ?? 0, byId.get(id)!)),
    forgetLater: [...plan.fenced, ...plan.continued].map((e) => e.rollout_id),
    restoredFrom: sendAs.restored > 0 ? latest!.dir : null,
    participants,
  };
}

function readLatest(dir: CollectionDir): ReturnType<CollectionDir['latest']> {
  try {
    return dir.latest();
  } catch (err) {
    throw new CliFailure(`cannot read the latest checkpoint in ${dir.root}: ${describe(err)}`);
  }
}

/** Nothing is sent again before every attempt of it that may still run is retired everywhere. */
async function retireOrFail(
  ctx: CommandContext,
  participants: Participants,
  episodes: readonly EpisodeId[],
): Promise<void> {
  try {
    await retire(participants, generatedId('retire'), episodes, ctx.deadlineTs());
  } catch (err) {
    throw new CliFailure(
      `could not retire the ${episodes.length} row(s) the previous leg sent, so none is sent ` +
        `again: ${describe(err)}; run --resume again once every server is up`,
    );
  }
}

/**
 * Restores the plan's continued rows and resumes; when that fails, warns, retires the attempts
 * the restore would have installed and restarts the rows from their input after them.
 */
async function restoreOrRestart(
  ctx: CommandContext,
  participants: Participants,
  from: string | undefined,
  plan: ResumePlan,
): Promise<{ attempts: Map<string, number>; restored: number; fallback: number }> {
  if (from === undefined || plan.continued.length === 0) {
    return { attempts: plan.sendAs, restored: 0, fallback: 0 };
  }
  const keys = plan.continued.map(captureKey).join(',');
  const sub = subContext(ctx, ['restore', '--dir', from, '--episodes', keys]);
  try {
    const restored = await restoreCommand(sub);
    await resume(participants, String(restored.data.checkpoint_id), ctx.deadlineTs());
    return { attempts: plan.sendAs, restored: plan.continued.length, fallback: 0 };
  } catch (err) {
    ctx.progress(
      `warning: restoring ${from} failed (${describe(err)}); its ${plan.continued.length} ` +
        'row(s) start over from their input under a new attempt',
    );
    const fallback = restartAfterFailedRestore(plan.continued);
    await retireOrFail(ctx, participants, fallback.retire);
    return {
      attempts: new Map([...plan.sendAs, ...fallback.sendAs]),
      restored: 0,
      fallback: plan.continued.length,
    };
  } finally {
    sub.close();
  }
}
