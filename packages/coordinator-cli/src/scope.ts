/**
 * What the participants' status replies say about the open checkpoint and the episodes in
 * flight, pure. The rule for "every episode in flight" (the commit scope when `--episodes` is not
 * given):
 *
 * - Environment servers own the episodes. Each one's status lists its live episodes in `episodes`
 *   and its unclaimed restored episodes, by their replacement attempt, in `restored_pending`
 *   (capture keys; see the README for this contract).
 * - The scope is the union of both over every environment server, minus every restart any
 *   participant reports in `report.restarts` (a restart is never exported; committing it is 409
 *   `restart_in_scope`).
 * - Read after a successful prepare, the set is stable: admission is closed and no episode
 *   completes while the stack is prepared.
 */
import { type ParticipantMember } from '@ckpt-gym/core/client';
import { captureKey, type EpisodeId, parseCaptureKey } from '@ckpt-gym/core/protocol';

import { CliFailure, type StatusReplies } from './context.js';
import { stringList } from './output.js';

/** Status extras of an environment participant (the contract of the environment package). */
export const EPISODES_FIELD = 'episodes';
export const RESTORED_PENDING_FIELD = 'restored_pending';

/**
 * The checkpoint open on the participants: undefined when none is, a failure when they disagree
 * (the controller must name the one it means with `--id`).
 */
export function openCheckpointId(replies: StatusReplies): string | undefined {
  const open = new Map<string, string[]>();
  for (const [server, reply] of Object.entries(replies)) {
    const id = reply.checkpoint_id;
    if (typeof id === 'string') open.set(id, [...(open.get(id) ?? []), server]);
  }
  if (open.size > 1) {
    const listed = [...open].map(([id, servers]) => `${id} on ${servers.sort().join(', ')}`);
    throw new CliFailure(`several checkpoints are open (${listed.join('; ')}); pass --id`);
  }
  return open.keys().next().value;
}

/** Restarts every participant reports in its status, sorted. */
export function reportedRestarts(replies: StatusReplies): string[] {
  const keys = new Set<string>();
  for (const reply of Object.values(replies)) {
    const report = reply.report as Record<string, unknown> | undefined;
    for (const key of stringList(report?.restarts)) keys.add(key);
  }
  return [...keys].sort();
}

export interface InFlight {
  /** The continued episodes: live and unclaimed restored, minus restarts; sorted by key. */
  readonly scope: EpisodeId[];
  /** Restarts left out of the scope, sorted. */
  readonly restarts: string[];
}

/** The commit scope from status replies (see the module comment); `extraRestarts` are also left out. */
export function episodesInFlight(
  members: readonly ParticipantMember[],
  replies: StatusReplies,
  extraRestarts: readonly string[] = [],
): InFlight {
  const keys = new Set<string>();
  for (const member of members.filter((m) => m.kind === 'environment')) {
    const reply = replies[member.server] ?? {};
    if (!Array.isArray(reply[EPISODES_FIELD])) {
      throw new CliFailure(
        `environment server ${member.server} does not list its episodes in its status ` +
          `('${EPISODES_FIELD}'); name the scope with --episodes`,
      );
    }
    for (const key of stringList(reply[EPISODES_FIELD])) keys.add(key);
    for (const key of stringList(reply[RESTORED_PENDING_FIELD])) keys.add(key);
  }
  const restarts = new Set([...reportedRestarts(replies), ...extraRestarts]);
  const scope = [...keys]
    .filter((key) => !restarts.has(key))
    .sort()
    .map((key) => {
      try {
        return parseCaptureKey(key);
      } catch (err) {
        throw new CliFailure(
          `a status reply lists the bad capture key ${JSON.stringify(key)}: ${(err as Error).message}`,
        );
      }
    });
  return { scope, restarts: [...restarts].sort() };
}

export function keysOf(episodes: readonly EpisodeId[]): string[] {
  return episodes.map(captureKey);
}
