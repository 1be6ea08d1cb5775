/** `restore`: install a checkpoint into fresh processes, all or nothing. */
import { checkRestore, restore } from '@ckpt-gym/core/client';
import { CheckpointStateError, type EpisodeId } from '@ckpt-gym/core/protocol';

import { PROGRAM } from '../args.js';
import { CliFailure, type CommandContext, generatedId } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import { type CommandResult, formatKeys, formatSeconds, stringList, table } from '../output.js';
import { expectedCheckpoint, publishedScope, readControllerRecord } from '../publication.js';
import { keysOf } from '../scope.js';
import { rowsByMember, timed, union } from './common.js';

export async function restoreCommand(ctx: CommandContext): Promise<CommandResult> {
  try {
    return await restoreChecked(ctx);
  } catch (err) {
    if (!(err instanceof CheckpointStateError)) throw err;
    // The checkpoint was refused before any participant was sent it: say so with the code.
    throw new CliFailure(
      `${err.code} (${err.status}), nothing was restored: ${err.message}`,
      {},
      ExitCode.FAILURE,
      { refusal: err.toBody().error },
    );
  }
}

async function restoreChecked(ctx: CommandContext): Promise<CommandResult> {
  const participants = await ctx.participants();
  const dir = ctx.checkpointDir();
  const record = await readControllerRecord(dir, ctx.stack.checkpoint?.signingKey);
  const requested = ctx.invocation.episodes ?? publishedScope(dir, record);
  const expected = record && expectedCheckpoint(dir, record);
  // Asked for explicitly: episodes not held where they must be start over instead of refusing.
  let scope: readonly EpisodeId[] = requested;
  let restarts: EpisodeId[] = [];
  if (ctx.invocation.restartMissing) {
    ({ scope, restarts } = await checkRestore(participants, dir, requested, {
      expected,
      allowRestart: true,
    }));
  }
  const id = ctx.invocation.id ?? generatedId('restore');
  const deadlineTs = ctx.deadlineTs();
  const { value: replies, seconds } = await timed(ctx, `restore ${id} from ${dir}`, () =>
    restore(participants, id, dir, scope, deadlineTs, { expected }),
  );
  const restored = union(Object.values(replies).map((reply) => stringList(reply.restored)));
  const restartKeys = keysOf(restarts);
  return {
    exitCode: ExitCode.OK,
    data: {
      checkpoint_id: id,
      checkpoint_dir: dir,
      deadline_ts: deadlineTs,
      seconds,
      episode_ids: keysOf(scope),
      restarts: restartKeys,
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
      ...(restartKeys.length > 0
        ? [
            `restarts (held by no environment, left out; retire them and send them again from ` +
              `their input): ${formatKeys(restartKeys)}`,
          ]
        : []),
      `next: ${PROGRAM} resume --id ${id}, then send each rollout again as its next attempt;`,
      `forget every restored rollout once it is done for good (${PROGRAM} forget --rollouts …)`,
    ].join('\n'),
  };
}
