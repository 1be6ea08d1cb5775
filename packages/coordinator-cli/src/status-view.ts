/**
 * What `status` and `status --watch` show of each server, pure: a status reply in, the view's
 * fields out (in flight, held, waiting, workers, the last checkpoint), and their renderings: the
 * workers table, the live frame, and one text or JSON line a refresh.
 */
import type { LastCheckpoint } from '@ckpt-gym/core/server';

import { table } from './output.js';

/** One server as `status` asked it. */
export interface ServerStatus {
  server: string;
  kind: string;
  url: string | null;
  /** False when the server answers 404: checkpoint routes are not installed. */
  participant: boolean;
  status?: Record<string, unknown>;
  error?: string;
}

export interface WorkerView {
  readonly index: number;
  readonly pid: number;
  readonly ready: boolean;
}

/** A server's workers, as its coordinator reports them (`workers`, `expected_workers`, `lost_workers`). */
export interface WorkersView {
  readonly workers: readonly WorkerView[];
  readonly expected: number;
  readonly lost: number;
}

/** What the watch shows of one server; null where the server does not report it. */
export interface WatchedServer {
  readonly server: string;
  readonly kind: string;
  /** The participant's phase, or `not a participant`, or `error`. */
  readonly phase: string;
  readonly checkpoint_id: string | null;
  readonly inflight: number | null;
  readonly held: number | null;
  readonly waiting: number | null;
  readonly workers: WorkersView | null;
  readonly last_checkpoint: LastCheckpoint | null;
  readonly error?: string;
}

function record(value: unknown): Record<string, unknown> {
  return typeof value === 'object' && value !== null ? (value as Record<string, unknown>) : {};
}

/** The first of `keys` that `from` holds as a number. */
function firstCount(from: Record<string, unknown>, keys: readonly string[]): number | null {
  for (const key of keys) {
    const value = from[key];
    if (typeof value === 'number') return value;
  }
  return null;
}

// Each kind names its counts its own way (its readiness report and status extras).
const INFLIGHT_KEYS = ['inflight', 'episodes', 'sessions'];
const HELD_KEYS = ['held'];
const WAITING_KEYS = ['waiting', 'waiting_for_resume'];

/** The workers a status reply lists; null when the server reports none (it runs one process). */
export function workersOf(status: Record<string, unknown>): WorkersView | null {
  if (!Array.isArray(status.workers)) return null;
  const workers = status.workers.map((entry: unknown) => {
    const worker = record(entry);
    return {
      index: typeof worker.index === 'number' ? worker.index : -1,
      pid: typeof worker.pid === 'number' ? worker.pid : -1,
      ready: worker.ready === true,
    };
  });
  const lost = status.lost_workers;
  return {
    workers,
    expected:
      typeof status.expected_workers === 'number' ? status.expected_workers : workers.length,
    lost: Array.isArray(lost) ? lost.length : typeof lost === 'number' ? lost : 0,
  };
}

export function watchedServer(row: ServerStatus): WatchedServer {
  const base = { server: row.server, kind: row.kind };
  const none = { checkpoint_id: null, inflight: null, held: null, waiting: null };
  if (row.error !== undefined) {
    return {
      ...base,
      phase: 'error',
      ...none,
      workers: null,
      last_checkpoint: null,
      error: row.error,
    };
  }
  if (!row.status) {
    return { ...base, phase: 'not a participant', ...none, workers: null, last_checkpoint: null };
  }
  const status = row.status;
  const counts = record(record(status.report).counts);
  return {
    ...base,
    phase: String(status.phase ?? '?'),
    checkpoint_id: typeof status.checkpoint_id === 'string' ? status.checkpoint_id : null,
    inflight: firstCount(counts, INFLIGHT_KEYS),
    held: firstCount(counts, HELD_KEYS),
    waiting: firstCount(status, WAITING_KEYS) ?? firstCount(counts, WAITING_KEYS),
    workers: workersOf(status),
    last_checkpoint: (status.last_checkpoint as LastCheckpoint | null | undefined) ?? null,
  };
}

/**
 * Whether the server's workers report readiness: only while a checkpoint is open (idle, their
 * reports are not kept, so none of them reads as ready).
 */
function reportsReadiness(server: Pick<WatchedServer, 'phase'>): boolean {
  return server.phase !== 'idle';
}

/**
 * `2/2 up`, with a checkpoint open `2/2 up, 1 ready`, and `, 1 lost` once one left; `-` for a
 * server of one process.
 */
export function formatWorkers(server: Pick<WatchedServer, 'phase' | 'workers'>): string {
  const view = server.workers;
  if (view === null) return '-';
  const ready = view.workers.filter((worker) => worker.ready).length;
  return (
    `${view.workers.length}/${view.expected} up` +
    (reportsReadiness(server) ? `, ${ready} ready` : '') +
    (view.lost > 0 ? `, ${view.lost} lost` : '')
  );
}

/**
 * The workers of the servers that run several, one row each (READY `-` while no checkpoint is
 * open); empty when none does.
 */
export function workersTable(servers: readonly WatchedServer[]): string {
  const rows = servers.flatMap((s) =>
    s.workers !== null && Math.max(s.workers.expected, s.workers.workers.length) > 1
      ? s.workers.workers.map((w) => [
          s.server,
          String(w.index),
          String(w.pid),
          reportsReadiness(s) ? (w.ready ? 'yes' : 'no') : '-',
        ])
      : [],
  );
  return rows.length === 0 ? '' : table(['SERVER', 'WORKER', 'PID', 'READY'], rows);
}

const count = (value: number | null): string => (value === null ? '-' : String(value));

/** `commit ok 40 ms (export 20, records_write 18)` for each operation of the last checkpoint. */
export function lastCheckpointParts(last: LastCheckpoint | null): string[] {
  if (last === null) return [];
  return Object.entries(last.operations).map(([operation, op]) => {
    const stages = op.stages.map((stage) => `${stage.name} ${stage.ms}`).join(', ');
    return `${operation} ${op.outcome} ${op.ms} ms${stages === '' ? '' : ` (${stages})`}`;
  });
}

/** The live view on a terminal: one table of every server, the last checkpoints, the workers. */
export function watchFrame(title: string, servers: readonly WatchedServer[]): string {
  const last = servers.flatMap((s) =>
    lastCheckpointParts(s.last_checkpoint).map((part) => [
      s.server,
      s.last_checkpoint?.checkpoint_id ?? '',
      part,
    ]),
  );
  const workers = workersTable(servers);
  return [
    title,
    '',
    table(
      ['SERVER', 'KIND', 'PHASE', 'CHECKPOINT', 'INFLIGHT', 'HELD', 'WAITING', 'WORKERS'],
      servers.map((s) => [
        s.server,
        s.kind,
        s.phase,
        s.checkpoint_id ?? '-',
        count(s.inflight),
        count(s.held),
        count(s.waiting),
        formatWorkers(s),
      ]),
    ),
    ...(last.length > 0
      ? ['', 'last checkpoint:', table(['SERVER', 'CHECKPOINT', 'OPERATION'], last)]
      : []),
    ...(workers === '' ? [] : ['', 'workers:', workers]),
    ...servers.flatMap((s) => (s.error === undefined ? [] : [`${s.server}: ${s.error}`])),
  ].join('\n');
}

/** One text line a refresh: `<time> policy phase=idle inflight=3 … | env …`. */
export function watchLine(at: Date, servers: readonly WatchedServer[]): string {
  const parts = servers.map((s) => {
    const fields = [
      `phase=${s.phase.replaceAll(' ', '_')}`,
      ...(s.checkpoint_id === null ? [] : [`checkpoint=${s.checkpoint_id}`]),
      `inflight=${count(s.inflight)}`,
      `held=${count(s.held)}`,
      `waiting=${count(s.waiting)}`,
      ...(s.workers === null ? [] : [`workers=${formatWorkers(s).replaceAll(' ', '_')}`]),
      ...(s.last_checkpoint === null ? [] : [`last=${s.last_checkpoint.checkpoint_id}`]),
      ...lastCheckpointParts(s.last_checkpoint).map((part) => `[${part}]`),
      ...(s.error === undefined ? [] : [`error=${JSON.stringify(s.error)}`]),
    ];
    return `${s.server} ${fields.join(' ')}`;
  });
  return `${at.toISOString()} ${parts.join(' | ')}`;
}

/** One JSON object a refresh (`--json`). */
export function watchJsonLine(at: Date, servers: readonly WatchedServer[]): string {
  return JSON.stringify({ at: at.toISOString(), servers });
}
