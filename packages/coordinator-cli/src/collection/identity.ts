/**
 * A collection's identity: one run id for the whole run (kept across `--resume`), and every
 * rollout id derived from it and the task's own key, so two runs never share a rollout id (and
 * never a capture ledger file, which is named after the rollout's capture key).
 */
import { randomBytes } from 'node:crypto';

import { episodeId, MAX_ROLLOUT_ID_LENGTH } from '@ckpt-gym/core/protocol';

import { CliFailure } from '../context.js';
import { ExitCode } from '../exit-codes.js';

/** `run-<UTC second>-<6 hex>`: sortable by start, unique across runs started the same second. */
export function newRunId(now: Date = new Date(), random: string = randomBytes(3).toString('hex')) {
  const stamp = now.toISOString().slice(0, 19).replace(/[-:]/g, '');
  return `run-${stamp}-${random}`;
}

/**
 * The rollout id of the task keyed `taskKey` in run `runId`: `<run id>.<task key>`. One that core
 * would refuse (longer than MAX_ROLLOUT_ID_LENGTH, a bad character, a reserved `-aN` ending) is a
 * usage error naming the task, before anything is sent.
 */
export function rolloutIdFor(runId: string, taskKey: string): string {
  const id = `${runId}.${taskKey}`;
  if (id.length > MAX_ROLLOUT_ID_LENGTH) {
    throw new CliFailure(
      `task ${JSON.stringify(taskKey)}: its rollout id ${id.length} characters long is over ` +
        `${MAX_ROLLOUT_ID_LENGTH}; give it a rollout_id of at most ` +
        `${MAX_ROLLOUT_ID_LENGTH - runId.length - 1} characters`,
      {},
      ExitCode.USAGE,
    );
  }
  try {
    return episodeId(id).rollout_id;
  } catch (err) {
    throw new CliFailure(
      `task ${JSON.stringify(taskKey)}: ${(err as Error).message}`,
      {},
      ExitCode.USAGE,
    );
  }
}
