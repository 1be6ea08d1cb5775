/** Helpers the checkpoint commands share. */
import type { ControlReply, Participants, Replies } from '@ckpt-gym/core/client';

import { parseCommandLine } from '../args.js';
import { CliFailure, CommandContext } from '../context.js';
import { formatSeconds } from '../output.js';
import { openCheckpointId } from '../scope.js';

export function kindOf(participants: Participants, server: string): string {
  return participants.members.find((member) => member.server === server)?.kind ?? '?';
}

/** Rows for every participant in prepare order, with `cells` of its reply (or of none). */
export function rowsByMember(
  participants: Participants,
  replies: Replies,
  cells: (reply: ControlReply | undefined, server: string) => string[],
): string[][] {
  return participants.members.map((member) => [
    member.server,
    member.kind,
    ...cells(replies[member.server], member.server),
  ]);
}

/** `--id`, or the checkpoint open on the participants; undefined when none is open. */
export async function idOrOpen(
  ctx: CommandContext,
  participants: Participants,
): Promise<string | undefined> {
  if (ctx.invocation.id !== undefined) return ctx.invocation.id;
  return openCheckpointId(await ctx.statuses(participants));
}

/** `--id`, or the open checkpoint; a failure naming the command when neither exists. */
export async function requireId(ctx: CommandContext, participants: Participants): Promise<string> {
  const id = await idOrOpen(ctx, participants);
  if (id === undefined) {
    throw new CliFailure(
      `no checkpoint is open on any participant; pass --id to ${ctx.invocation.command}`,
    );
  }
  return id;
}

/** Runs `work`, printing a progress line before and one with the time it took after. */
export async function timed<T>(
  ctx: CommandContext,
  stage: string,
  work: () => Promise<T>,
): Promise<{ value: T; seconds: number }> {
  ctx.progress(`${stage} …`);
  const started = performance.now();
  const value = await work();
  const seconds = (performance.now() - started) / 1000;
  ctx.progress(`${stage}: done in ${formatSeconds(seconds)}`);
  return { value, seconds };
}

/** Exported capture keys by server, from commit replies' `episode_ids`. */
export function exportedByServer(replies: Replies): Record<string, string[]> {
  const out: Record<string, string[]> = {};
  for (const [server, reply] of Object.entries(replies)) {
    out[server] = Array.isArray(reply.episode_ids)
      ? reply.episode_ids.filter((key): key is string => typeof key === 'string')
      : [];
  }
  return out;
}

/** Record counts by server, from commit replies' manifests. */
export function recordCounts(replies: Replies): Record<string, number> {
  const out: Record<string, number> = {};
  for (const [server, reply] of Object.entries(replies)) {
    const count = (reply.manifest as { record_count?: unknown } | undefined)?.record_count;
    out[server] = typeof count === 'number' ? count : 0;
  }
  return out;
}

export function union(lists: Iterable<readonly string[]>): string[] {
  const all = new Set<string>();
  for (const list of lists) for (const key of list) all.add(key);
  return [...all].sort();
}

/** A context for another command (`checkpoint`, `restore`, …) on the same stack file and io. */
export function subContext(ctx: CommandContext, argv: string[]): CommandContext {
  const parsed = parseCommandLine([...argv, '--config', ctx.configPath]);
  if (parsed.kind !== 'invoke') throw new Error(`bad internal command line: ${argv.join(' ')}`);
  return new CommandContext(
    { ...parsed.invocation, deadlineSeconds: ctx.invocation.deadlineSeconds },
    ctx.io,
  );
}
