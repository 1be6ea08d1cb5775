/**
 * Our output rows, the identity any output row carries (ours or NeMo Gym's), and the capture
 * failures of an attempt read from its lineage ledger rows. Pure.
 */
import type { ResultRow } from '../collect.js';
import { type JsonRow, ROLLOUT_ID_KEY, RUN_ID_KEY } from './nemo.js';

/** An output row of ours: the reply, its episode and run, and any failed capture. */
export function ckptOutputRow(runId: string, row: ResultRow, captureFailures: readonly string[]) {
  return {
    run_id: runId,
    ...row,
    ...(captureFailures.length > 0 ? { capture_failures: [...captureFailures] } : {}),
  };
}

/** The rollout and run an output line names (ours or NeMo Gym's); blank and torn lines name none. */
export function outputIdentity(line: string): { rolloutId: string; runId?: string } | undefined {
  let row: JsonRow;
  try {
    row = JSON.parse(line) as JsonRow;
  } catch {
    return undefined;
  }
  const rolloutId = row.rollout_id ?? row[ROLLOUT_ID_KEY];
  const runId = row.run_id ?? row[RUN_ID_KEY];
  if (typeof rolloutId !== 'string') return undefined;
  return typeof runId === 'string' ? { rolloutId, runId } : { rolloutId };
}

/** The rollouts with an outcome in `texts`, and the runs those rows belong to. */
export function outcomesIn(texts: readonly string[]): { finished: Set<string>; runs: Set<string> } {
  const finished = new Set<string>();
  const runs = new Set<string>();
  for (const line of texts.flatMap((text) => text.split('\n'))) {
    const identity = outputIdentity(line);
    if (identity === undefined) continue;
    finished.add(identity.rolloutId);
    runs.add(identity.runId ?? '(no run id)');
  }
  return { finished, runs };
}

/** `<model call id>: <reason>` for each lineage row (a ledger line) that records a failure. */
export function captureFailuresIn(ledgerText: string): string[] {
  const failures: string[] = [];
  for (const line of ledgerText.split('\n')) {
    if (line.trim() === '') continue;
    let row: JsonRow;
    try {
      row = JSON.parse(line) as JsonRow;
    } catch {
      continue;
    }
    if (row.failure_reason !== undefined) {
      failures.push(`${String(row.model_call_id ?? '?')}: ${String(row.failure_reason)}`);
    }
  }
  return failures;
}
