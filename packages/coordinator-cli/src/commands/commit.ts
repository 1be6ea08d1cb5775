/** `commit`: every participant writes its records for the continued episodes, then the controller publishes. */
import { commit, type Participants, type Replies } from '@ckpt-gym/core/client';
import { type EpisodeId } from '@ckpt-gym/core/protocol';

import { PROGRAM } from '../args.js';
import { CliFailure, type CommandContext, type StatusReplies } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import { type CommandResult, formatKeys, formatSeconds, table } from '../output.js';
import { controllerRecord, publish } from '../publication.js';
import { episodesInFlight, type InFlight, keysOf, openCheckpointId } from '../scope.js';
import { exportedByServer, recordCounts, rowsByMember, timed, union } from './common.js';

export async function commitCommand(ctx: CommandContext): Promise<CommandResult> {
  const participants = await ctx.participants();
  let statuses: StatusReplies | undefined;
  const status = async (): Promise<StatusReplies> =>
    (statuses ??= await ctx.statuses(participants));

  const id = ctx.invocation.id ?? openCheckpointId(await status());
  if (id === undefined) {
    throw new CliFailure(`no checkpoint is open on any participant; prepare first or pass --id`);
  }
  const given = ctx.invocation.episodes;
  const inFlight: InFlight = given
    ? { scope: [...given], restarts: [] }
    : episodesInFlight(participants.members, await status());
  const committed = await commitAndPublish(ctx, participants, id, inFlight);
  return {
    exitCode: ExitCode.OK,
    data: committed.data,
    text: [committed.text, '', `next: ${PROGRAM} resume --id ${id}`].join('\n'),
  };
}

export interface Committed {
  readonly replies: Replies;
  readonly seconds: number;
  readonly data: Record<string, unknown>;
  readonly text: string;
}

/** Commits `inFlight.scope` everywhere, then publishes `<dir>/controller.json`. */
export async function commitAndPublish(
  ctx: CommandContext,
  participants: Participants,
  id: string,
  inFlight: InFlight,
): Promise<Committed> {
  const dir = ctx.checkpointDir();
  const scope: readonly EpisodeId[] = inFlight.scope;
  const stop = ctx.invocation.stop;
  const deadlineTs = ctx.deadlineTs();
  const { value: replies, seconds } = await timed(
    ctx,
    `commit ${id} (${scope.length} episode(s))`,
    () => commit(participants, id, dir, scope, deadlineTs, { stop }),
  );
  const exported = exportedByServer(replies);
  const counts = recordCounts(replies);
  const published = await publish(
    dir,
    controllerRecord({
      checkpointId: id,
      publishedAt: ctx.nowSeconds(),
      scope,
      restarts: inFlight.restarts,
      recordCounts: counts,
      exportedByServer: exported,
    }),
    ctx.stack.checkpoint?.signingKey,
  );
  const exportedKeys = union(Object.values(exported));
  return {
    replies,
    seconds,
    data: {
      checkpoint_id: id,
      checkpoint_dir: dir,
      deadline_ts: deadlineTs,
      stop,
      seconds,
      episode_ids: keysOf(scope),
      restarts: inFlight.restarts,
      exported: exportedKeys,
      exported_by_server: exported,
      published,
      replies,
    },
    text: [
      table(
        ['SERVER', 'KIND', 'RECORDS', 'EXPORTED'],
        rowsByMember(participants, replies, (_reply, server) => [
          String(counts[server] ?? 0),
          formatKeys(exported[server] ?? []),
        ]),
      ),
      '',
      `checkpoint ${id} committed to ${dir} in ${formatSeconds(seconds)}: ` +
        `${scope.length} episode(s) in scope, ${exportedKeys.length} exported: ${formatKeys(exportedKeys)}`,
      `published ${published}`,
    ].join('\n'),
  };
}
