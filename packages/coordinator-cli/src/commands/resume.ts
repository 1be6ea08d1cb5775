/** `resume`: reopen admission in reverse prepare order; nothing open is nothing to do. */
import { resume } from '@ckpt-gym/core/client';

import type { CommandContext } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import { type CommandResult, formatSeconds, table } from '../output.js';
import { idOrOpen, rowsByMember, timed } from './common.js';

export async function resumeCommand(ctx: CommandContext): Promise<CommandResult> {
  const participants = await ctx.participants();
  const id = await idOrOpen(ctx, participants);
  if (id === undefined) {
    return {
      exitCode: ExitCode.OK,
      data: { checkpoint_id: null, replies: {} },
      text: 'no checkpoint is open on any participant; nothing to resume',
    };
  }
  const deadlineTs = ctx.deadlineTs();
  const { value: replies, seconds } = await timed(ctx, `resume ${id}`, () =>
    resume(participants, id, deadlineTs),
  );
  return {
    exitCode: ExitCode.OK,
    data: { checkpoint_id: id, deadline_ts: deadlineTs, seconds, replies },
    text: [
      table(
        ['SERVER', 'KIND', 'PHASE', 'IDEMPOTENT'],
        rowsByMember(participants, replies, (reply) => [
          String(reply?.phase ?? '-'),
          reply?.idempotent === true ? 'yes' : 'no',
        ]),
      ),
      '',
      `resumed ${id} in ${formatSeconds(seconds)}`,
    ].join('\n'),
  };
}
