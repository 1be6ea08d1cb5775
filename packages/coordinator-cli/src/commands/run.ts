/**
 * `run`: collect rollouts, checkpointed as NeMo Gym's rollout collection is (#3893). Tasks from
 * `--input` (ours, or NeMo Gym rows) go to an environment server of the stack, `--concurrency`
 * at once; each outcome is appended to `--output` once.
 *
 * A run has an id, in every output row and at the head of its dispatch log; every rollout id is
 * derived from it. A first leg refuses an output that already holds rows; `--resume` starts the
 * next leg of the run its `--output` and `--checkpoint-dir` name (the rules: collection/resume.ts),
 * and refuses an output of another run. Checkpoints: run-checkpoints.ts.
 */
import { readFileSync } from 'node:fs';
import { mkdir } from 'node:fs/promises';
import { resolve } from 'node:path';

import { forget, retire } from '@ckpt-gym/core/client';
import { serversByKind, serverUrl } from '@ckpt-gym/core/server';

import {
  Collector,
  type InputFormat,
  type InputTask,
  inputTasks,
  type ResultRow,
} from '../collect.js';
import { CollectionDir } from '../collection/files.js';
import { newRunId } from '../collection/identity.js';
import { type JsonRow, nemoOutputRow } from '../collection/nemo.js';
import { captureFailures, Outputs } from '../collection/outputs.js';
import { progressLine, tenth } from '../collection/progress.js';
import { ckptOutputRow } from '../collection/rows.js';
import { CliFailure, type CommandContext, describe, generatedId } from '../context.js';
import { type CommandResult } from '../output.js';
import { CollectionCheckpoints } from './run-checkpoints.js';
import { dispatchOf, type Leg, type LegOutcome, type RunTasks, runTasksOf } from './run-leg.js';
import { resumeLeg } from './run-resume.js';
import { runSummary } from './run-summary.js';

export async function runCommand(ctx: CommandContext): Promise<CommandResult> {
  const inv = ctx.invocation;
  const input = resolve(ctx.io.cwd, inv.input ?? '');
  const output = resolve(ctx.io.cwd, inv.output ?? '');
  const dir = new CollectionDir(
    resolve(ctx.io.cwd, inv.checkpointDir ?? `${inv.output}.checkpoints`),
  );
  const { format, tasks } = readInput(ctx, input);
  const outputs = new Outputs(output, format);
  await mkdir(dir.root, { recursive: true });
  const leg = inv.resume
    ? await resumeLeg(ctx, dir, tasks, outputs)
    : await firstLeg(ctx, dir, tasks, outputs);
  const all = runTasksOf(leg.head.run_id, tasks);
  const outcome = await collectLeg(ctx, { dir, outputs, leg, format, tasks: all });
  if (outcome.stoppedAt === undefined) await cleanUp(ctx, leg, outcome);
  return runSummary({ input, output: outputs, dir: dir.root, leg, total: all.size, outcome });
}

function readInput(
  ctx: CommandContext,
  input: string,
): { format: InputFormat; tasks: InputTask[] } {
  const inv = ctx.invocation;
  try {
    return inputTasks(readFileSync(input, 'utf8'), {
      format: inv.format,
      limit: inv.limit,
      numRepeats: inv.numRepeats,
    });
  } catch (err) {
    throw new CliFailure(`${input}: ${describe(err)}`);
  }
}

/** A new run: nothing of another run may be in its output, nor restored from its directory. */
async function firstLeg(
  ctx: CommandContext,
  dir: CollectionDir,
  tasks: readonly InputTask[],
  outputs: Outputs,
): Promise<Leg> {
  const { finished, runs } = outputs.read();
  if (finished.size > 0) {
    throw new CliFailure(
      `${outputs.path} already holds ${finished.size} outcome(s) of run ${[...runs].join(', ')}: ` +
        'finish that run with --resume (and its --checkpoint-dir), or write to a new --output',
    );
  }
  const previous = dir.readLog();
  if (previous !== undefined) {
    ctx.progress(`new run in ${dir.root}: run ${previous.run_id}'s checkpoints there are removed`);
    dir.reset();
  }
  const head = { run_id: newRunId(), leg: 0 };
  const dispatches = [...runTasksOf(head.run_id, tasks)].map(([id, t]) => dispatchOf(id, 0, t));
  await dir.startLog(head, []);
  return { head, dispatches, forgetLater: [], restoredFrom: null };
}

/** The environment server `run` collects through: `--server`, else the stack's first. */
function environment(ctx: CommandContext): { url: string; flat: boolean } {
  const name = ctx.invocation.server;
  const envs = serversByKind(ctx.stack, 'environment');
  const server = name === undefined ? envs[0] : envs.find((s) => s.name === name);
  if (!server) {
    throw new CliFailure(
      `${ctx.configPath}: ${name === undefined ? 'no environment server' : `no environment server ${name}`}`,
    );
  }
  const app = (server as { app?: unknown }).app;
  return { url: serverUrl(ctx.stack, server.name), flat: app === 'single_agent_turn_legacy' };
}

interface LegContext {
  readonly dir: CollectionDir;
  readonly outputs: Outputs;
  readonly leg: Leg;
  readonly format: InputFormat;
  readonly tasks: RunTasks;
}

/** Sends the leg's dispatches, writes each outcome, takes the checkpoints asked for. */
async function collectLeg(ctx: CommandContext, run: LegContext): Promise<LegOutcome> {
  const { leg, outputs } = run;
  const finished = outputs.read().finished;
  const counts = { written: 0, failed: 0 };
  const lost: LegOutcome['lost'] = [];
  const captureFailed: LegOutcome['captureFailed'] = [];
  const bar = progressBar(ctx, run.tasks.size, finishedAmong(finished, run.tasks));
  const env = environment(ctx);
  const collector: Collector = new Collector({
    envUrl: env.url,
    flat: env.flat,
    concurrency: ctx.invocation.concurrency,
    client: ctx.clients.data,
    onSend: (d) => run.dir.logSend(d.episode),
    onLost: (d, reason) => lost.push({ episode: d.episode, reason }),
    onResult: async (row) => {
      if (finished.has(row.rollout_id)) return;
      finished.add(row.rollout_id);
      const failures = captureFailures(ctx.stack.tokenCapture, row);
      if (failures.length > 0) captureFailed.push({ episode: row, failures });
      const out = outputRow(run, row, failures);
      counts.written += 1;
      if (out.failed) counts.failed += 1;
      bar(finishedAmong(finished, run.tasks), collector.inFlight.size - 1);
      await outputs.write(out.row, out.failed);
    },
  });
  const checkpoints = new CollectionCheckpoints(ctx, run.dir, leg.head, collector);
  const uninstall = checkpoints.install(ctx.invocation.checkpointEverySeconds);
  await run.dir.writePid(process.pid);
  ctx.progress(
    `run ${leg.head.run_id} (leg ${leg.head.leg}): collector pid ${process.pid}; ` +
      `checkpoint it with: ckpt-gym checkpoint-now --checkpoint-dir ${run.dir.root}`,
  );
  try {
    collector.enqueue(leg.dispatches);
    await collector.settled();
    await checkpoints.settled();
    await outputs.flushed();
  } finally {
    uninstall();
    run.dir.removePid();
  }
  return {
    ...counts,
    finished: finishedAmong(finished, run.tasks),
    lost,
    captureFailed,
    checkpoints: checkpoints.published,
    stoppedAt: checkpoints.stoppedAt,
  };
}

function finishedAmong(finished: ReadonlySet<string>, tasks: RunTasks): number {
  let n = 0;
  for (const id of tasks.keys()) if (finished.has(id)) n += 1;
  return n;
}

/** The output row of a reply: NeMo Gym's shape for NeMo Gym rows, else ours. */
function outputRow(
  run: LegContext,
  row: ResultRow,
  failures: readonly string[],
): { failed: boolean; row: JsonRow } {
  const runId = run.leg.head.run_id;
  const task = run.tasks.get(row.rollout_id);
  if (run.format === 'nemo' && task?.row !== undefined) {
    const ids = { runId, rolloutId: row.rollout_id, attempt: row.attempt };
    return nemoOutputRow({ key: task.key, row: task.row }, ids, {
      ...row,
      captureFailures: failures,
    });
  }
  return {
    failed: row.failure !== null || failures.length > 0,
    row: ckptOutputRow(runId, row, failures),
  };
}

/**
 * A progress bar with rate and ETA on a terminal, else a line at every tenth of the way; the
 * rate counts only what this leg finished.
 */
function progressBar(ctx: CommandContext, total: number, doneBefore: number) {
  const tty = (ctx.io.stderr as { isTTY?: boolean }).isTTY === true;
  const started = ctx.nowSeconds();
  let lastTenth = -1;
  const draw = (done: number, inFlight: number) => {
    const state = {
      done,
      total,
      inFlight,
      doneHere: done - doneBefore,
      elapsedSeconds: ctx.nowSeconds() - started,
    };
    if (tty) {
      ctx.io.stderr.write(`\r${progressLine(state, true)}${done >= total ? '\n' : ''}`);
      return;
    }
    if (tenth(done, total) === lastTenth) return;
    lastTenth = tenth(done, total);
    ctx.progress(progressLine(state, false));
  };
  draw(doneBefore, 0);
  return draw;
}

/**
 * After a leg that was not stopped: rows whose `/run` got no reply are retired everywhere (a
 * harness may still run them; a later leg restarts them), then every rollout the leg retired or
 * restored is forgotten. Both best effort: the stack may be gone.
 */
async function cleanUp(ctx: CommandContext, leg: Leg, outcome: LegOutcome): Promise<void> {
  const rollouts = [...leg.forgetLater, ...outcome.lost.map((l) => l.episode.rollout_id)];
  if (rollouts.length === 0) return;
  try {
    const participants = leg.participants ?? (await ctx.participants());
    if (outcome.lost.length > 0) {
      const episodes = outcome.lost.map((l) => l.episode);
      await retire(participants, generatedId('retire'), episodes, ctx.deadlineTs());
    }
    await forget(participants, generatedId('forget'), [...new Set(rollouts)], ctx.deadlineTs());
  } catch (err) {
    ctx.progress(`warning: retire/forget after the run failed: ${describe(err)}`);
  }
}
