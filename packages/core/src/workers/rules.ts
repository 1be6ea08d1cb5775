/** The coordinator's rules, as small pure functions. */
import { CheckpointError } from '../errors.js';
import type { JsonObject, JsonValue } from '../json.js';
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

/**
 * One report out of the workers' own participants' reports (`ParticipantCoordinator`): ready only
 * when every worker is, blockers and restarts unioned, blocker counts and counts summed (an episode
 * runs on one worker, so no blocker is counted twice).
 */
export function mergeReadiness(reports: readonly PrepareReport[]): PrepareReport {
  const blockers = new Set<string>();
  const restarts = new Set<string>();
  const counts: Record<string, number> = {};
  let ready = true;
  let blockerCount = 0;
  for (const report of reports) {
    ready &&= report.ready;
    blockerCount += report.blocker_count;
    for (const key of report.blockers) blockers.add(key);
    for (const key of report.restarts) restarts.add(key);
    for (const [name, n] of Object.entries(report.counts)) counts[name] = (counts[name] ?? 0) + n;
  }
  return {
    ready,
    blockers: [...blockers].sort().slice(0, MAX_REPORTED_BLOCKERS),
    blocker_count: blockerCount,
    counts,
    restarts: [...restarts].sort(),
  };
}

/**
 * Refuses a commit's export unless every expected worker answered it and none was lost since
 * admission closed: what a lost worker held is unknown, so the checkpoint is refused rather than
 * weakened (the plane keeps the failure: `export_failed`).
 */
export function checkExportAnswers(
  label: string,
  workers: {
    readonly expected: number;
    readonly answered: number;
    readonly lostSinceClose: boolean;
  },
): void {
  if (workers.lostSinceClose) {
    throw new CheckpointError(
      `a ${label} worker was lost after admission closed; what it held is unknown`,
    );
  }
  if (workers.answered < workers.expected) {
    throw new CheckpointError(
      `only ${workers.answered} of ${workers.expected} ${label} workers answered the commit's export`,
    );
  }
}

/** The workers' status extras as one: lists unioned and sorted, numbers summed, the rest left out. */
export function mergeStatuses(statuses: readonly JsonObject[]): Record<string, unknown> {
  const lists = new Map<string, Set<JsonValue>>();
  const sums = new Map<string, number>();
  for (const status of statuses) {
    for (const [name, value] of Object.entries(status)) {
      if (Array.isArray(value)) {
        const list = lists.get(name) ?? new Set();
        for (const item of value) list.add(item);
        lists.set(name, list);
      } else if (typeof value === 'number') {
        sums.set(name, (sums.get(name) ?? 0) + value);
      }
    }
  }
  const merged: Record<string, unknown> = Object.fromEntries(sums);
  for (const [name, list] of lists) merged[name] = [...list].sort();
  return merged;
}
