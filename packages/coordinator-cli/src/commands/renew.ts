/** `renew`: extend every participant's lease on the open checkpoint. */
import { renew } from '@ckpt-gym/core/client';

import type { CommandContext } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import { type CommandResult, formatLease, table } from '../output.js';
import { requireId, rowsByMember, timed } from './common.js';

export async function renewCommand(ctx: CommandContext): Promise<CommandResult> {
  const participants = await ctx.participants();
  const id = await requireId(ctx, participants);
  const deadlineTs = ctx.deadlineTs();
  const { value: replies, seconds } = await timed(ctx, `renew ${id}`, () =>
    renew(participants, id, deadlineTs),
  );
  const now = ctx.nowSeconds();
  return {
    exitCode: ExitCode.OK,
    data: { checkpoint_id: id, deadline_ts: deadlineTs, seconds, replies },
    text: [
      table(
        ['SERVER', 'KIND', 'LEASE'],
        rowsByMember(participants, replies, (reply) => [formatLease(reply?.lease_expires_at, now)]),
      ),
      '',
      `renewed the leases of ${id}`,
    ].join('\n'),
  };
}
