/**
 * Prometheus metrics of one gym server, served at `GET /metrics` in the text format (prom-client:
 * `docs/telemetry.md` says why, and lists every name and label). One `GymMetrics` per app, on a
 * registry of its own (tests run many servers in one process; the global registry would mix
 * them), with the server's name and kind on every series. Checkpoint metrics come from a control
 * observer, HTTP metrics and refusals from the request middleware (`http.ts`), and the call gauges
 * are read from the participant at scrape time: nothing is counted twice on a hot path.
 */
import type { RequestHandler } from 'express';
import {
  AggregatorRegistry,
  Counter,
  Gauge,
  Histogram,
  type MetricObjectWithValues,
  type MetricValue,
  Registry,
} from 'prom-client';

import type {
  ControlObserver,
  ObservedOperation,
  OperationEvent,
  StageName,
} from '../control/observer.js';
import type { Participant } from '../participant.js';

/** Where every gym server serves its metrics: no bearer, no admission (Prometheus scrapes it). */
export const METRICS_PATH = '/metrics';

/**
 * Checkpoint buckets, ms: a readiness wait or an 8,000-episode export runs for seconds to minutes,
 * far past prom-client's default 10 s top bucket.
 */
export const CHECKPOINT_BUCKETS_MS = [
  1, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 120_000, 300_000,
  600_000,
];

/** HTTP buckets, ms: a tool call answers in under a millisecond, a held model call in minutes. */
export const HTTP_BUCKETS_MS = [
  0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 120_000, 600_000,
];

/** What the events counter counts (`event` label); `refused` carries the error's `code`. */
export type GymEvent =
  | 'refused'
  | 'lease_expired'
  | 'lease_expiry_failed'
  | 'cut_failed'
  | 'worker_lost'
  | 'worker_lost_during_checkpoint'
  | 'export_failed'
  | 'park_failed'
  | 'reopen_failed'
  | 'not_ready'
  | 'prepare_abandoned';

/** The call states the `gym_calls` gauge reports. */
export type CallState = 'in_flight' | 'waiting' | 'held' | 'parked';

/**
 * Which of a participant's readiness counts is which call state: each kind names its counts its
 * own way (the policy's `held` model calls, the agent's sessions `at_boundary`, the environment's
 * `episodes`); a count not listed here is no call state.
 */
const CALL_STATE_OF_COUNT: Readonly<Record<string, CallState>> = {
  inflight: 'in_flight',
  episodes: 'in_flight',
  waiting: 'waiting',
  waiting_for_resume: 'waiting',
  held: 'held',
  at_boundary: 'parked',
};

/** The call states in a participant's readiness counts (absent states are not reported). */
export function callStates(counts: Readonly<Record<string, number>>): Map<CallState, number> {
  const states = new Map<CallState, number>();
  for (const [name, value] of Object.entries(counts)) {
    const state = CALL_STATE_OF_COUNT[name];
    if (state !== undefined) states.set(state, (states.get(state) ?? 0) + value);
  }
  return states;
}

/** The operations whose records and bytes are counted: a commit writes them, a restore reads them. */
const MOVES_RECORDS = new Set<string>(['commit', 'restore']);

/** The stages each operation may run (`control/observer.ts` says which runs when). */
const OPERATION_STAGES: Readonly<Record<ObservedOperation, readonly StageName[]>> = {
  prepare: ['close_admission', 'cut_round', 'readiness_wait'],
  commit: ['export', 'records_write', 'restored_cleanup', 'park'],
  restore: ['close_admission', 'cut_round', 'read', 'install_wait', 'install'],
  retire: ['install_wait', 'retire_drain'],
};

/** The plane's events, counted without a code. */
const PLANE_EVENTS: readonly GymEvent[] = [
  'lease_expired',
  'lease_expiry_failed',
  'export_failed',
  'park_failed',
  'reopen_failed',
  'not_ready',
  'prepare_abandoned',
];

/** Another process's metrics, as its registry's JSON (`Registry.getMetricsAsJSON`). */
export type MetricsJson = MetricObjectWithValues<MetricValue<string>>[];

export interface GymMetricsOptions {
  /** The server's name in the stack file (label `server`). */
  readonly server: string;
  /** The server kind (label `kind`). */
  readonly kind: string;
}

/** The instruments of one server. */
export class GymMetrics {
  readonly registry = new Registry();
  readonly #operations: Histogram<'operation' | 'outcome'>;
  readonly #stages: Histogram<'operation' | 'stage'>;
  readonly #records: Counter<'operation'>;
  readonly #bytes: Counter<'operation'>;
  readonly #events: Counter<'event' | 'code'>;
  readonly #http: Histogram<'method' | 'route' | 'status'>;
  readonly #sources: (() => Promise<MetricsJson>)[] = [];

  constructor(options: GymMetricsOptions) {
    this.registry.setDefaultLabels({ server: options.server, kind: options.kind });
    const registers = [this.registry];
    this.#operations = new Histogram({
      name: 'gym_checkpoint_operation_duration_ms',
      help: 'Wall time of each admitted checkpoint operation on this participant, ms.',
      labelNames: ['operation', 'outcome'],
      buckets: CHECKPOINT_BUCKETS_MS,
      registers,
    });
    this.#stages = new Histogram({
      name: 'gym_checkpoint_stage_duration_ms',
      help: 'Wall time of each slow stage of a checkpoint operation, ms.',
      labelNames: ['operation', 'stage'],
      buckets: CHECKPOINT_BUCKETS_MS,
      registers,
    });
    this.#records = new Counter({
      name: 'gym_checkpoint_records_total',
      help: 'Records written (commit) and read (restore) by successful operations.',
      labelNames: ['operation'],
      registers,
    });
    this.#bytes = new Counter({
      name: 'gym_checkpoint_bytes_total',
      help: 'Bytes of records files written (commit) and read (restore) by successful operations.',
      labelNames: ['operation'],
      registers,
    });
    this.#events = new Counter({
      name: 'gym_checkpoint_events_total',
      help: 'Refusals by error code, lease expiries, cut failures, lost workers and other failures.',
      labelNames: ['event', 'code'],
      registers,
    });
    this.#http = new Histogram({
      name: 'gym_http_request_duration_ms',
      help: 'HTTP requests by method, route template and status, ms (its _count is the request count).',
      labelNames: ['method', 'route', 'status'],
      buckets: HTTP_BUCKETS_MS,
      registers,
    });
    this.#zeroKnownSeries();
  }

  /**
   * Starts the series of every known label set at zero: a series born at its first value has no
   * earlier sample, so `rate` and `increase` would not see a server's first checkpoint.
   */
  #zeroKnownSeries(): void {
    for (const [operation, stages] of Object.entries(OPERATION_STAGES)) {
      this.#operations.zero({ operation, outcome: 'ok' });
      for (const stage of stages) this.#stages.zero({ operation, stage });
    }
    for (const operation of MOVES_RECORDS) {
      this.#records.inc({ operation }, 0);
      this.#bytes.inc({ operation }, 0);
    }
    for (const event of PLANE_EVENTS) this.#events.inc({ event }, 0);
  }

  /** One admitted operation ended: its time, its stages', and what it moved when it succeeded. */
  observeOperation(event: OperationEvent): void {
    const { operation } = event;
    this.#operations.observe({ operation, outcome: event.outcome }, event.ms);
    for (const stage of event.stages) {
      this.#stages.observe({ operation, stage: stage.name }, stage.ms);
    }
    if (event.outcome !== 'ok' || !MOVES_RECORDS.has(operation)) return;
    this.#records.inc({ operation }, event.episodes);
    if (event.bytes !== undefined) this.#bytes.inc({ operation }, event.bytes);
  }

  /** Counts one event (`labels.code` for a refusal); the seam for events outside the plane. */
  countEvent(event: GymEvent, labels: { code?: string } = {}, amount = 1): void {
    this.#events.inc({ event, ...labels }, amount);
  }

  /** One HTTP request ended; `route` is its template (never the raw path). */
  observeRequest(method: string, route: string, status: number, ms: number): void {
    this.#http.observe({ method, route, status: String(status) }, ms);
  }

  /**
   * Reads the participant's call gauges and restored pending episodes at each scrape, and counts
   * the cut failures it reports (a running count the policy keeps) as `cut_failed` events.
   */
  watchParticipant(participant: Participant): void {
    let cutFailures = 0;
    const readCounts = () => {
      const counts = participant.readiness().counts;
      const failures = counts.cut_failures ?? 0;
      if (failures > cutFailures) this.countEvent('cut_failed', {}, failures - cutFailures);
      cutFailures = Math.max(cutFailures, failures);
      return counts;
    };
    new Gauge({
      name: 'gym_calls',
      help: 'Calls and episodes on this participant by state: in_flight, waiting, held, parked.',
      labelNames: ['state'],
      registers: [this.registry],
      collect() {
        this.reset();
        for (const [state, value] of callStates(readCounts())) this.set({ state }, value);
      },
    });
    new Gauge({
      name: 'gym_restored_pending_episodes',
      help: 'Replacement attempts a restore installed that no request has claimed yet.',
      registers: [this.registry],
      collect() {
        this.set(participant.restoredPending().length);
      },
    });
  }

  /**
   * Adds another process's metrics to every scrape, summed series by series with this registry's:
   * a worker of a server with several workers serves its coordinator's (the primary serves no HTTP).
   */
  addSource(source: () => Promise<MetricsJson>): void {
    this.#sources.push(source);
  }

  /** The text a scrape gets. */
  async scrape(): Promise<string> {
    if (this.#sources.length === 0) return this.registry.metrics();
    const all = await Promise.all([
      this.registry.getMetricsAsJSON(),
      ...this.#sources.map((source) => source()),
    ]);
    return AggregatorRegistry.aggregate(all).metrics();
  }
}

/** The plane's events as metrics (refusals are counted by the one error path, not here). */
export function metricsObserver(metrics: GymMetrics): ControlObserver {
  return {
    onOperation: (event) => metrics.observeOperation(event),
    onNotReady: () => metrics.countEvent('not_ready'),
    onPrepareAbandoned: () => metrics.countEvent('prepare_abandoned'),
    onExportFailed: () => metrics.countEvent('export_failed'),
    onParkFailed: () => metrics.countEvent('park_failed'),
    onReopenFailed: () => metrics.countEvent('reopen_failed'),
    onLeaseExpired: () => metrics.countEvent('lease_expired'),
    onLeaseExpiryFailed: () => metrics.countEvent('lease_expiry_failed'),
  };
}

/** `GET /metrics`: the registry in Prometheus's text format. */
export function metricsHandler(metrics: GymMetrics): RequestHandler {
  return (_req, res, next) => {
    metrics.scrape().then((text) => {
      res.setHeader('content-type', metrics.registry.contentType);
      res.end(text);
    }, next);
  };
}
