/** `prepare`: close admission stage by stage and wait for readiness; exit 3 when not prepared in time. */
import {
  CoordinationError,
  type Participants,
  prepare,
  type PrepareResult,
} from '@ckpt-gym/core/client';
import { captureKey } from '@ckpt-gym/core/protocol';

import { PROGRAM } from '../args.js';
import { CliFailure, type CommandContext, generatedId } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import { type CommandResult, formatKeys, formatSeconds, stringList, table } from '../output.js';
import { rowsByMember, timed } from './common.js';

export async function prepareCommand(ctx: CommandContext): Promise<CommandResult> {
  const participants = await ctx.participants();
  const id = ctx.invocation.id ?? generatedId('ckpt');
  const deadlineTs = ctx.deadlineTs();
  let prepared;
  try {
    prepared = await timed(ctx, `prepare ${id}`, () => prepare(participants, id, deadlineTs));
  } catch (err) {
    if (!(err instanceof CoordinationError)) throw err;
    throw new CliFailure(
      `prepare of ${id} failed on ${Object.keys(err.failures).length} participant(s); ` +
        `the stages prepared before it stay closed until you resume: ${PROGRAM} resume --id ${id}`,
      err.failures,
      ExitCode.FAILURE,
      { checkpoint_id: id },
    );
  }
  const { value: result, seconds } = prepared;
  const lines = [prepareTable(participants, result), ''];
  if (result.prepared) {
    lines.push(
      `checkpoint ${id} prepared in ${formatSeconds(seconds)}.`,
      restartsLine(result),
      `next: ${PROGRAM} commit --id ${id} --dir DIR, then ${PROGRAM} resume --id ${id}`,
    );
  } else {
    lines.push(
      `checkpoint ${id} was NOT prepared by its deadline (${formatSeconds(seconds)}); blockers above.`,
      `admission stays closed on the contacted participants until you resume: ${PROGRAM} resume --id ${id}`,
    );
  }
  return {
    exitCode: result.prepared ? ExitCode.OK : ExitCode.NOT_PREPARED,
    data: { checkpoint_id: id, deadline_ts: deadlineTs, seconds, ...prepareData(result) },
    text: lines.join('\n'),
  };
}

/** The JSON details of a prepare: its outcome, blockers by server, restarts, the replies. */
export function prepareData(result: PrepareResult): Record<string, unknown> {
  return {
    prepared: result.prepared,
    blockers: result.blockers(),
    restarts: result.restarts().map(captureKey),
    replies: result.replies,
  };
}

export function restartsLine(result: PrepareResult): string {
  const restarts = result.restarts().map(captureKey);
  return restarts.length === 0
    ? 'restarts: none'
    : `restarts (never exported; after a crash retire them and start them over): ${formatKeys(restarts)}`;
}

/** One row per participant: its prepare phase, blockers and restarts (stages never reached: not contacted). */
export function prepareTable(participants: Participants, result: PrepareResult): string {
  return table(
    ['SERVER', 'KIND', 'PHASE', 'BLOCKERS', 'RESTARTS'],
    rowsByMember(participants, result.replies, (reply) => {
      if (!reply) return ['not contacted', '', ''];
      const report = (reply.report ?? {}) as Record<string, unknown>;
      const blockers = stringList(report.blockers);
      const count =
        typeof report.blocker_count === 'number' ? report.blocker_count : blockers.length;
      return [
        String(reply.phase ?? '?'),
        count === 0 ? '0' : `${count}: ${formatKeys(blockers)}`,
        formatKeys(stringList(report.restarts)),
      ];
    }),
  );
}
