/**
 * `run`: collect rollouts. Tasks from `--input` go to the stack's (first) environment server,
 * `--concurrency` at once; each reply is appended to `--output` once, with its attempt.
 *
 * SIGUSR1 takes a checkpoint into `--checkpoint-dir/<id>` and goes on; SIGTERM takes one with
 * `stop` and exits 75. Every send is journaled (`<checkpoint-dir>/attempts.jsonl`) before it
 * leaves, so `--resume` knows the attempt each rollout last ran: it restores the latest published
 * checkpoint, re-sends the episodes it continued as their next attempt, retires every other
 * rollout without a result at its last attempt and re-sends it from its input, and skips rollouts
 * that already have a result.
 */
import { existsSync, mkdirSync, readdirSync, readFileSync } from 'node:fs';
import { appendFile } from 'node:fs/promises';
import { join, resolve } from 'node:path';

import {
  type EpisodeId,
  forget,
  nextAttempt,
  parseCaptureKey,
  type Participants,
  resume,
  retire,
  serversByKind,
  serverUrl,
} from '@ckpt-gym/core';

import { parseCommandLine } from '../args.js';
import { Collector, type Dispatch, type InputTask, parseTasks } from '../collect.js';
import { CliFailure, CommandContext, describe, generatedId } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import { type CommandResult, table } from '../output.js';
import { CONTROLLER_FILE, type ControllerRecord, parseControllerRecord } from '../publication.js';
import { checkpointCommand } from './checkpoint.js';
import { restoreCommand } from './restore.js';

export const ATTEMPTS_FILE = 'attempts.jsonl';

/** The latest published checkpoint under `dir` (by `published_at`), or undefined. */
export function latestCheckpoint(
  dir: string,
): { dir: string; record: ControllerRecord } | undefined {
  if (!existsSync(dir)) return undefined;
  let latest: { dir: string; record: ControllerRecord } | undefined;
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    if (!entry.isDirectory()) continue;
    const path = join(dir, entry.name, CONTROLLER_FILE);
    if (!existsSync(path)) continue;
    const record = parseControllerRecord(readFileSync(path, 'utf8'), path);
    if (!latest || record.published_at > latest.record.published_at) {
      latest = { dir: join(dir, entry.name), record };
    }
  }
  return latest;
}

/** Rollout id → the highest attempt journaled. */
export function journaledAttempts(text: string): Map<string, number> {
  const attempts = new Map<string, number>();
  for (const line of text.split('\n')) {
    if (line.trim() === '') continue;
    const { rollout_id: id, attempt } = JSON.parse(line) as EpisodeId;
    attempts.set(id, Math.max(attempt, attempts.get(id) ?? -1));
  }
  return attempts;
}

/** Rollout ids that already have a result line. */
export function finishedRollouts(text: string): Set<string> {
  const done = new Set<string>();
  for (const line of text.split('\n')) {
    if (line.trim() === '') continue;
    done.add((JSON.parse(line) as { rollout_id: string }).rollout_id);
  }
  return done;
}

function readText(path: string): string {
  return existsSync(path) ? readFileSync(path, 'utf8') : '';
}

/** What a resume sends: continued episodes and restarts, each as its next attempt. */
export function resumePlan(
  tasks: readonly InputTask[],
  finished: ReadonlySet<string>,
  attempts: ReadonlyMap<string, number>,
  scope: readonly EpisodeId[],
): { continued: EpisodeId[]; retired: EpisodeId[]; fresh: string[] } {
  const scoped = new Map(scope.map((e) => [e.rollout_id, e]));
  const continued: EpisodeId[] = [];
  const retired: EpisodeId[] = [];
  const fresh: string[] = [];
  for (const { rolloutId } of tasks) {
    if (finished.has(rolloutId)) continue;
    const inScope = scoped.get(rolloutId);
    const last = attempts.get(rolloutId);
    if (inScope !== undefined) continued.push(inScope);
    else if (last !== undefined) retired.push({ rollout_id: rolloutId, attempt: last });
    else fresh.push(rolloutId);
  }
  return { continued, retired, fresh };
}

/** A progress bar on a terminal; otherwise a line at every tenth of the way. */
function progressBar(ctx: CommandContext, total: number): (done: number, inFlight: number) => void {
  const tty = (ctx.io.stderr as { isTTY?: boolean }).isTTY === true;
  let lastTenth = -1;
  return (done, inFlight) => {
    const width = 30;
    const filled = total === 0 ? width : Math.round((done / total) * width);
    const line = `[${'#'.repeat(filled)}${'.'.repeat(width - filled)}] ${done}/${total} done, ${inFlight} in flight`;
    if (tty) {
      ctx.io.stderr.write(`\r${line}${done === total ? '\n' : ''}`);
      return;
    }
    const tenth = total === 0 ? 10 : Math.floor((done / total) * 10);
    if (tenth !== lastTenth) {
      lastTenth = tenth;
      ctx.progress(line);
    }
  };
}

export async function runCommand(ctx: CommandContext): Promise<CommandResult> {
  const inv = ctx.invocation;
  const input = resolve(ctx.io.cwd, inv.input ?? '');
  const output = resolve(ctx.io.cwd, inv.output ?? '');
  const checkpointRoot = resolve(ctx.io.cwd, inv.checkpointDir ?? `${inv.output}.checkpoints`);
  let tasks: InputTask[];
  try {
    tasks = parseTasks(readFileSync(input, 'utf8'));
  } catch (err) {
    throw new CliFailure(`${input}: ${describe(err)}`);
  }
  mkdirSync(checkpointRoot, { recursive: true });
  const byId = new Map(tasks.map((t) => [t.rolloutId, t.task]));
  const [envServer] = serversByKind(ctx.stack, 'environment');
  if (!envServer) throw new CliFailure(`${ctx.configPath}: no environment server`);
  const envUrl = serverUrl(ctx.stack, envServer.name);
  const journal = join(checkpointRoot, ATTEMPTS_FILE);
  const finished = finishedRollouts(readText(output));

  const total = tasks.length;
  let done = finished.size;
  let written = 0;
  const bar = progressBar(ctx, total);
  let writes = Promise.resolve();
  const collector = new Collector({
    envUrl,
    concurrency: inv.concurrency,
    client: ctx.clients.data,
    onSend: (d) => appendFile(journal, `${JSON.stringify(d.episode)}\n`),
    onResult: (row) => {
      if (finished.has(row.rollout_id)) return undefined;
      finished.add(row.rollout_id);
      writes = writes.then(() => appendFile(output, `${JSON.stringify(row)}\n`));
      done += 1;
      written += 1;
      bar(done, collector.inFlight.size - 1);
      return writes;
    },
  });

  // What to send: everything without a result, or (resume) the plan from the checkpoint.
  let dispatches: Dispatch[];
  let participants: Participants | undefined;
  const forgetLater: string[] = [];
  let restoredFrom: string | null = null;
  if (inv.resume) {
    participants = await ctx.participants();
    const latest = latestCheckpoint(checkpointRoot);
    const scope = latest ? latest.record.episode_ids.map(parseCaptureKey) : [];
    if (latest) {
      restoredFrom = latest.dir;
      const restoreCtx = subContext(ctx, ['restore', '--dir', latest.dir]);
      try {
        const restored = await restoreCommand(restoreCtx);
        await resume(participants, String(restored.data.checkpoint_id), ctx.deadlineTs());
      } finally {
        restoreCtx.close();
      }
    }
    const plan = resumePlan(tasks, finished, journaledAttempts(readText(journal)), scope);
    if (plan.retired.length > 0) {
      await retire(participants, generatedId('retire'), plan.retired, ctx.deadlineTs());
    }
    forgetLater.push(...[...plan.continued, ...plan.retired].map((e) => e.rollout_id));
    dispatches = [
      ...[...plan.continued, ...plan.retired].map(nextAttempt),
      ...plan.fresh.map((id) => ({ rollout_id: id, attempt: 0 })),
    ].map((episode) => ({ episode, task: byId.get(episode.rollout_id)! }));
    ctx.progress(
      `resume${latest ? ` from ${latest.dir}` : ' (no checkpoint)'}: ${plan.continued.length} continued, ` +
        `${plan.retired.length} restarted, ${plan.fresh.length} not started, ${finished.size} finished`,
    );
  } else {
    dispatches = tasks
      .filter((t) => !finished.has(t.rolloutId))
      .map((t) => ({ episode: { rollout_id: t.rolloutId, attempt: 0 }, task: t.task }));
  }

  // Checkpoints on signals: SIGUSR1 goes on, SIGTERM stops.
  let stopped: string | undefined;
  let checkpoints: string[] = [];
  let checkpointing = Promise.resolve();
  const takeCheckpoint = (stop: boolean) => {
    checkpointing = checkpointing.then(async () => {
      if (stopped !== undefined) return;
      collector.pause();
      const id = generatedId('ckpt');
      const sub = subContext(ctx, [
        'checkpoint',
        '--id',
        id,
        '--dir',
        join(checkpointRoot, id),
        ...(stop ? ['--stop'] : []),
      ]);
      try {
        const result = await checkpointCommand(sub);
        ctx.progress(result.text);
        if (result.exitCode === ExitCode.OK) {
          checkpoints = [...checkpoints, id];
          if (stop) {
            stopped = id;
            collector.abort();
          }
        }
      } catch (err) {
        ctx.progress(`checkpoint failed: ${describe(err)}`);
      } finally {
        sub.close();
        if (stopped === undefined) collector.unpause();
      }
    });
  };
  const onUsr1 = () => takeCheckpoint(false);
  const onTerm = () => takeCheckpoint(true);
  process.on('SIGUSR1', onUsr1);
  process.on('SIGTERM', onTerm);
  try {
    bar(done, 0);
    collector.enqueue(dispatches);
    await collector.settled();
    await checkpointing;
    await writes;
  } finally {
    process.off('SIGUSR1', onUsr1);
    process.off('SIGTERM', onTerm);
  }

  const data = {
    input,
    output,
    checkpoint_dir: checkpointRoot,
    restored_from: restoredFrom,
    total,
    written,
    finished: finished.size,
    checkpoints,
    lost: [...collector.lost.values()].map((l) => ({
      episode_id: l.dispatch.episode,
      reason: l.reason,
    })),
  };
  if (stopped !== undefined) {
    return {
      exitCode: ExitCode.COLLECTION_STOPPED,
      data: { ...data, stopped_at: stopped },
      text: `stopped after checkpoint ${stopped}: ${finished.size}/${total} finished; continue with --resume after the stack is back`,
    };
  }
  if (participants && forgetLater.length > 0) {
    await forget(participants, generatedId('forget'), forgetLater, ctx.deadlineTs()).catch(
      (err: unknown) => ctx.progress(`warning: forget failed: ${describe(err)}`),
    );
  }
  const lostRows = data.lost.map((l) => [
    `${l.episode_id.rollout_id}-a${l.episode_id.attempt}`,
    l.reason,
  ]);
  return {
    exitCode: collector.lost.size === 0 ? ExitCode.OK : ExitCode.FAILURE,
    data,
    text: [
      `${written} result(s) written to ${output}; ${finished.size}/${total} finished`,
      ...(lostRows.length > 0 ? ['', 'no result for:', table(['EPISODE', 'WHY'], lostRows)] : []),
    ].join('\n'),
  };
}

/** A context for one of the checkpoint commands, on the same stack file and io. */
function subContext(ctx: CommandContext, argv: string[]): CommandContext {
  const parsed = parseCommandLine([...argv, '--config', ctx.configPath]);
  if (parsed.kind !== 'invoke') throw new Error(`bad internal command line: ${argv.join(' ')}`);
  return new CommandContext(
    { ...parsed.invocation, deadlineSeconds: ctx.invocation.deadlineSeconds },
    ctx.io,
  );
}
