/** `retire` and `forget`: callers first, under the open (restored) checkpoint's id or a new one. */
import { forget, type Participants, type Replies, retire } from '@ckpt-gym/core/client';

import { CliFailure, type CommandContext, generatedId } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import { type CommandResult, formatKeys, formatSeconds, table } from '../output.js';
import { keysOf } from '../scope.js';
import { idOrOpen, rowsByMember, timed } from './common.js';

/** Outside a checkpoint any id is admitted; after a restore it must be the restore's. */
async function outsideCheckpointId(
  ctx: CommandContext,
  participants: Participants,
  prefix: string,
): Promise<string> {
  return (await idOrOpen(ctx, participants)) ?? generatedId(prefix);
}

function countTable(
  participants: Participants,
  replies: Replies,
  field: string,
  header: string,
): string {
  return table(
    ['SERVER', 'KIND', header],
    rowsByMember(participants, replies, (reply) => [
      reply === undefined ? 'not contacted' : String(reply[field] ?? '?'),
    ]),
  );
}

export async function retireCommand(ctx: CommandContext): Promise<CommandResult> {
  const episodes = ctx.invocation.episodes;
  if (!episodes) throw new CliFailure('retire needs --episodes');
  const participants = await ctx.participants();
  const id = await outsideCheckpointId(ctx, participants, 'retire');
  const deadlineTs = ctx.deadlineTs();
  const { value: replies, seconds } = await timed(ctx, `retire ${episodes.length} episode(s)`, () =>
    retire(participants, id, episodes, deadlineTs),
  );
  return {
    exitCode: ExitCode.OK,
    data: {
      checkpoint_id: id,
      deadline_ts: deadlineTs,
      seconds,
      episode_ids: keysOf(episodes),
      replies,
    },
    text: [
      countTable(participants, replies, 'retired_count', 'RETIRED'),
      '',
      `retired ${formatKeys(keysOf(episodes))} in ${formatSeconds(seconds)}; ` +
        'their late requests are refused until forget',
    ].join('\n'),
  };
}

export async function forgetCommand(ctx: CommandContext): Promise<CommandResult> {
  const rollouts = [
    ...new Set([
      ...(ctx.invocation.rollouts ?? []),
      ...(ctx.invocation.episodes ?? []).map((episode) => episode.rollout_id),
    ]),
  ];
  if (rollouts.length === 0) throw new CliFailure('forget needs --rollouts or --episodes');
  const participants = await ctx.participants();
  const id = await outsideCheckpointId(ctx, participants, 'forget');
  const deadlineTs = ctx.deadlineTs();
  const { value: replies, seconds } = await timed(ctx, `forget ${rollouts.length} rollout(s)`, () =>
    forget(participants, id, rollouts, deadlineTs),
  );
  return {
    exitCode: ExitCode.OK,
    data: { checkpoint_id: id, deadline_ts: deadlineTs, seconds, rollout_ids: rollouts, replies },
    text: [
      countTable(participants, replies, 'forgotten_count', 'FORGOTTEN'),
      '',
      `forgot ${formatKeys(rollouts)} in ${formatSeconds(seconds)}`,
    ].join('\n'),
  };
}
