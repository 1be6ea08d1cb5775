/** `restore`: install a checkpoint into fresh processes, all or nothing. */
import { restore } from '@ckpt-gym/core';

import { PROGRAM } from '../args.js';
import { type CommandContext, generatedId } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import { type CommandResult, formatKeys, formatSeconds, stringList, table } from '../output.js';
import { publishedScope } from '../publication.js';
import { keysOf } from '../scope.js';
import { rowsByMember, timed, union } from './common.js';

export async function restoreCommand(ctx: CommandContext): Promise<CommandResult> {
  const participants = await ctx.participants();
  const dir = ctx.checkpointDir();
  const scope =
    ctx.invocation.episodes ?? (await publishedScope(dir, ctx.stack.checkpoint?.signingKey));
  const id = ctx.invocation.id ?? generatedId('restore');
  const deadlineTs = ctx.deadlineTs();
  const { value: replies, seconds } = await timed(ctx, `restore ${id} from ${dir}`, () =>
    restore(participants, id, dir, scope, deadlineTs),
  );
  const restored = union(Object.values(replies).map((reply) => stringList(reply.restored)));
  return {
    exitCode: ExitCode.OK,
    data: {
      checkpoint_id: id,
      checkpoint_dir: dir,
      deadline_ts: deadlineTs,
      seconds,
      episode_ids: keysOf(scope),
      restored,
      replies,
    },
    text: [
      table(
        ['SERVER', 'KIND', 'SOURCE', 'RESTORED'],
        rowsByMember(participants, replies, (reply) => [
          String(reply?.source_checkpoint_id ?? '-'),
          formatKeys(stringList(reply?.restored)),
        ]),
      ),
      '',
      `restored ${id} from ${dir} in ${formatSeconds(seconds)}: ${scope.length} episode(s) in scope, ` +
        `${restored.length} installed: ${formatKeys(restored)}`,
      `next: ${PROGRAM} resume --id ${id}, then send each rollout again as its next attempt;`,
      `forget every restored rollout once it is done for good (${PROGRAM} forget --rollouts …)`,
    ].join('\n'),
  };
}
