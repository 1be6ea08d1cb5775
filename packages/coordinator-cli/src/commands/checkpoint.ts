/**
 * `checkpoint`: prepare, commit every episode in flight, publish, resume — the whole cut in one
 * command, with each stage's time. Any failure after prepare resumes before it is reported, so a
 * failed checkpoint never leaves the stack closed; `--stop` alone skips the final resume.
 */
import { type Participants, prepare, resume } from '@ckpt-gym/core/client';
import { captureKey } from '@ckpt-gym/core/protocol';

import { CliFailure, type CommandContext, describe, generatedId } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import { type CommandResult, formatKeys, formatSeconds, table } from '../output.js';
import { episodesInFlight, type InFlight } from '../scope.js';
import { commitAndPublish } from './commit.js';
import { timed } from './common.js';
import { prepareData, prepareTable, restartsLine } from './prepare.js';

interface Stage {
  readonly stage: string;
  readonly seconds: number;
  readonly result: string;
}

function stageTable(stages: readonly Stage[]): string {
  return table(
    ['STAGE', 'TIME', 'RESULT'],
    stages.map((s) => [s.stage, formatSeconds(s.seconds), s.result]),
  );
}

type Prepared = Awaited<ReturnType<typeof prepare>>;

export async function checkpointCommand(ctx: CommandContext): Promise<CommandResult> {
  const participants = await ctx.participants();
  const id = ctx.invocation.id ?? generatedId('ckpt');
  // Before prepare: a missing --dir must not close the stack.
  const dir = ctx.checkpointDir();
  const stages: Stage[] = [];

  let prepared;
  try {
    prepared = await timed(ctx, `prepare ${id}`, () => prepare(participants, id, ctx.deadlineTs()));
  } catch (err) {
    // Earlier stages may have closed admission before a later one failed.
    await resumeAfterFailure(ctx, participants, id, describe(err), stages, {});
    throw err;
  }
  const result = prepared.value;
  const preparedData = prepareData(result);
  if (!result.prepared) {
    stages.push({
      stage: 'prepare',
      seconds: prepared.seconds,
      result: 'NOT prepared by the deadline',
    });
    const why = 'it was not prepared by its deadline';
    await resumeAfterFailure(ctx, participants, id, why, stages, preparedData);
    return notPrepared(participants, { id, dir }, result, stages);
  }
  stages.push({
    stage: 'prepare',
    seconds: prepared.seconds,
    result: `prepared (${participants.members.length} participants)`,
  });

  const stop = ctx.invocation.stop;
  let committed;
  try {
    committed = await commitAndPublish(
      ctx,
      participants,
      id,
      await inFlight(ctx, participants, result),
    );
  } catch (err) {
    await resumeAfterFailure(ctx, participants, id, describe(err), stages, preparedData);
    throw err;
  }
  const exported = committed.data.exported as string[];
  stages.push({
    stage: 'commit',
    seconds: committed.seconds,
    result: `${exported.length} episode(s) exported${stop ? ', stopped' : ''}`,
  });

  if (!stop) {
    const resumed = await timed(ctx, `resume ${id}`, () =>
      resume(participants, id, ctx.deadlineTs()),
    );
    stages.push({ stage: 'resume', seconds: resumed.seconds, result: 'admission open' });
  }
  return checkpointed({ id, dir, stop }, result, committed.data, stages);
}

/** The scope to commit: the episodes given, or every one in flight; and the restarts. */
async function inFlight(
  ctx: CommandContext,
  participants: Participants,
  result: Prepared,
): Promise<InFlight> {
  const restarts = result.restarts().map(captureKey);
  const given = ctx.invocation.episodes;
  return given
    ? { scope: result.continued(given), restarts }
    : episodesInFlight(participants.members, await ctx.statuses(participants), restarts);
}

function notPrepared(
  participants: Participants,
  { id, dir }: { id: string; dir: string },
  result: Prepared,
  stages: readonly Stage[],
): CommandResult {
  return {
    exitCode: ExitCode.NOT_PREPARED,
    data: {
      checkpoint_id: id,
      checkpoint_dir: dir,
      stages,
      ...prepareData(result),
      resumed: true,
    },
    text: [
      prepareTable(participants, result),
      '',
      stageTable(stages),
      '',
      `checkpoint ${id} was NOT prepared by its deadline; blockers above. ` +
        'Resumed: nothing was committed.',
    ].join('\n'),
  };
}

function checkpointed(
  { id, dir, stop }: { id: string; dir: string; stop: boolean },
  result: Prepared,
  committed: Record<string, unknown>,
  stages: readonly Stage[],
): CommandResult {
  const exported = committed.exported as string[];
  const total = stages.reduce((sum, s) => sum + s.seconds, 0);
  return {
    exitCode: ExitCode.OK,
    data: { ...committed, stages, seconds: total, prepare: prepareData(result), resumed: !stop },
    text: [
      stageTable(stages),
      '',
      `checkpoint ${id} in ${dir}: ${formatSeconds(total)}`,
      `exported: ${formatKeys(exported)}`,
      restartsLine(result),
      ...(stop
        ? [
            'stopped: the stack stays closed; stop its processes now (the participants reopen ' +
              'on their own when the lease expires)',
          ]
        : []),
    ].join('\n'),
  };
}

/**
 * Resumes after a failed stage and records it; a resume failure is reported with the prepare
 * details, since the participants then reopen only when their leases expire.
 */
async function resumeAfterFailure(
  ctx: CommandContext,
  participants: Participants,
  id: string,
  why: string,
  stages: Stage[],
  preparedData: Record<string, unknown>,
): Promise<void> {
  try {
    const resumed = await timed(ctx, `resume ${id}`, () =>
      resume(participants, id, ctx.deadlineTs()),
    );
    stages.push({ stage: 'resume', seconds: resumed.seconds, result: 'admission open' });
  } catch (err) {
    throw new CliFailure(
      `checkpoint ${id} failed (${why}) and the resume after it failed too: ${describe(err)}; ` +
        'the participants reopen when their leases expire',
      (err as { failures?: Record<string, string> }).failures ?? {},
      ExitCode.FAILURE,
      { checkpoint_id: id, stages, ...preparedData },
    );
  }
}
