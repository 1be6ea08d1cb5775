/** The coordinator's rules, as small pure functions. */
import { MAX_REPORTED_BLOCKERS, type PrepareReport } from '../participant.js';
import { REPLY_GRACE_MS } from './types.js';

/**
 * A report is kept only while admission is closed, only for the current generation (a report
 * from before the latest close describes another checkpoint), and only if it is newer than the
 * worker's kept one (the close reply and a pushed report can arrive in either order).
 */
export function reportKept(
  current: { readonly generation: number; readonly accepting: boolean },
  report: { readonly generation: number; readonly seq: number },
  keptSeq: number,
): boolean {
  return !current.accepting && report.generation === current.generation && report.seq > keptSeq;
}

export interface WorkersState {
  readonly label: string;
  readonly expectedWorkers: number;
  /** Workers whose report of the current generation is kept. */
  readonly reported: number;
  readonly lostWhileClosed: boolean;
}

/**
 * The coordinator's readiness: the merged report of the workers, blocked while fewer than the
 * expected workers reported or a worker was lost while admission was closed (what it held is
 * unknown, so the checkpoint is blocked rather than weakened). Its counts are the workers' counts
 * summed, nothing more (as NeMo Gym's coordinated participant merges them): an idle server
 * reports the same counts with one process or N; the workers themselves are in the status.
 */
export function readinessOf(merged: PrepareReport, workers: WorkersState): PrepareReport {
  const missing: string[] = [];
  const unreported = workers.expectedWorkers - workers.reported;
  if (unreported > 0) missing.push(`${workers.label}-workers-unreported:${unreported}`);
  if (workers.lostWhileClosed) missing.push(`${workers.label}-worker-lost`);
  return {
    ready: merged.ready && missing.length === 0,
    blockers: [...missing, ...merged.blockers].slice(0, MAX_REPORTED_BLOCKERS),
    blocker_count: merged.blocker_count + missing.length,
    counts: merged.counts,
    restarts: merged.restarts,
  };
}

/** How long to wait for a reply to work bounded by `deadlineTs` (seconds): to it, plus a grace. */
export function replyTimeoutMs(deadlineTs: number, nowMs: number): number {
  return Math.max(0, deadlineTs * 1000 - nowMs) + REPLY_GRACE_MS;
}

/** The pause before sending a failed report again: doubling from 50 ms, at most 1 s. */
export function reportRetryDelayMs(failures: number): number {
  return Math.min(1000, 50 * 2 ** Math.max(0, failures - 1));
}
