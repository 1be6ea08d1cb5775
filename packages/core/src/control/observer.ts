/**
 * What the control plane tells the world: each operation with where its time went, each refusal,
 * the lease running out and the failures it survives. The plane calls one `ControlObserver`; the
 * log lines are one observer (`logObserver`), and telemetry (spans, metrics) plugs in beside it
 * through the plane's `observers` option without touching the machine.
 */
import { CkptGymError } from '../errors.js';
import type { Logger } from '../logging.js';
import type { PrepareReport } from '../participant.js';
import type { Phase } from './phases.js';

/** The slow steps of the operations, in the order each operation runs them. */
export type StageName =
  /** prepare and restore: the participant closing admission. */
  | 'close_admission'
  /** prepare and restore: a model server's generation-cut round, once admission closed. */
  | 'cut_round'
  /** prepare: until the participant is ready, the deadline passes or the checkpoint changes. */
  | 'readiness_wait'
  /** commit: the participant's export (from before it starts: it may work synchronously). */
  | 'export'
  /** commit: the records file, then the manifest. */
  | 'records_write'
  /** commit with a scope: deleting the restored attempts the scope does not continue. */
  | 'restored_cleanup'
  /** commit with `stop`: the participant parking what it exported. */
  | 'park'
  /** restore: reading and verifying the checkpoint. */
  | 'read'
  /** restore and retire: waiting for an earlier restore's install to end. */
  | 'install_wait'
  /** restore: the participant installing the records. */
  | 'install'
  /** retire: stopping the rollouts, a bounded number at a time. */
  | 'retire_drain';

export interface StageTiming {
  readonly name: StageName;
  /** Wall time of the stage, ms. */
  readonly ms: number;
  /** CPU the whole process used meanwhile (every thread), ms. */
  readonly cpu_ms: number;
}

/** The operations that do slow work; the others are only reported when refused. */
export type ObservedOperation = 'prepare' | 'commit' | 'restore' | 'retire';

/** An operation that was admitted and ran (a replayed reply is not reported again). */
export interface OperationEvent {
  readonly operation: ObservedOperation;
  readonly checkpoint_id: string;
  /** 'ok', or the stable code of the error it failed with. */
  readonly outcome: string;
  /** The plane's phase once it ended (a prepare not ready at its deadline stays `preparing`). */
  readonly phase: Phase;
  /** The stages that ended, in order; a failed operation lists those before the failure. */
  readonly stages: readonly StageTiming[];
  /** `performance.now()` when the operation started, unrounded (its stages run back to back from it). */
  readonly started_at: number;
  /** Wall time and process CPU of the whole operation, ms. */
  readonly ms: number;
  readonly cpu_ms: number;
  /** Records exported (commit) or installed (restore), or attempts newly retired (retire). */
  readonly episodes: number;
  /** The records file's size, when the manifest has it (commit and restore). */
  readonly bytes?: number | undefined;
  /** restore: the checkpoint it read. */
  readonly source_checkpoint_id?: string;
}

/** A control call answered with an error. */
export interface RefusalEvent {
  readonly operation: string;
  readonly checkpoint_id: string | null;
  readonly code: string;
  readonly detail: string;
  /** Present when a hook threw something untyped, now answered as `checkpoint_error`. */
  readonly cause?: unknown;
}

/**
 * Every hook is optional. Hooks are called synchronously, most under the plane's lock: keep them
 * quick (record, do not await). A hook that throws is reported to the log and otherwise ignored.
 */
export interface ControlObserver {
  onOperation?(event: OperationEvent): void;
  onRefused?(event: RefusalEvent): void;
  /** A prepare's deadline passed before the participant was ready; admission stays closed. */
  onNotReady?(event: { checkpoint_id: string; report: PrepareReport }): void;
  /** A prepare that could not finish; its id is not fenced, so the controller may retry it. */
  onPrepareAbandoned?(event: { checkpoint_id: string | null; reason: string }): void;
  /** The export failed while its checkpoint was open: that checkpoint can never commit. */
  onExportFailed?(event: { checkpoint_id: string; error: string }): void;
  /** Parking the exported episodes failed after the checkpoint was durable. */
  onParkFailed?(event: { checkpoint_id: string; error: string }): void;
  /** Admission could not be reopened after a failed restore or prepare; the next resume retries. */
  onReopenFailed?(event: { error: string }): void;
  /** The lease ran out without a renewal: the plane ends the checkpoint. */
  onLeaseExpired?(event: { checkpoint_id: string; phase: Phase }): void;
  /** Ending the checkpoint at lease expiry failed; it is tried again after `retry_seconds`. */
  onLeaseExpiryFailed?(event: {
    checkpoint_id: string;
    retry_seconds: number;
    error: string;
  }): void;
}

export function describe(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}

/** The stable code an error is answered with (anything untyped becomes `checkpoint_error`). */
export function errorCode(err: unknown): string {
  return err instanceof CkptGymError ? err.code : 'checkpoint_error';
}

function stage(event: OperationEvent, name: StageName): StageTiming | undefined {
  return event.stages.find((s) => s.name === name);
}

/** Sums the stages not named in `except`: everything of a restore after its read, say. */
function sumStages(event: OperationEvent, except: StageName): { ms: number; cpu_ms: number } {
  const rest = event.stages.filter((s) => s.name !== except);
  return {
    ms: rest.reduce((sum, s) => sum + s.ms, 0),
    cpu_ms: rest.reduce((sum, s) => sum + s.cpu_ms, 0),
  };
}

function logOperation(logger: Logger, event: OperationEvent): void {
  if (event.outcome !== 'ok') return;
  if (event.operation === 'commit') {
    const exported = stage(event, 'export');
    const written = stage(event, 'records_write');
    logger.info('checkpoint committed', {
      checkpoint_id: event.checkpoint_id,
      records: event.episodes,
      export_ms: exported?.ms,
      write_ms: written?.ms,
      total_ms: event.ms,
      export_cpu_ms: exported?.cpu_ms,
      write_cpu_ms: written?.cpu_ms,
    });
  } else if (event.operation === 'restore') {
    const read = stage(event, 'read');
    const install = sumStages(event, 'read');
    logger.info('checkpoint restored', {
      checkpoint_id: event.checkpoint_id,
      source_checkpoint_id: event.source_checkpoint_id,
      records: event.episodes,
      read_ms: read?.ms,
      install_ms: install.ms,
      read_cpu_ms: read?.cpu_ms,
      install_cpu_ms: install.cpu_ms,
    });
  }
}

/** The plane's log lines: each event at the level and with the fields it has always had. */
export function logObserver(logger: Logger): ControlObserver {
  return {
    onOperation: (event) => logOperation(logger, event),
    onRefused(event) {
      if (!('cause' in event)) return;
      const cause = event.cause;
      logger.error(`checkpoint ${event.operation} failed`, {
        error: cause instanceof Error ? (cause.stack ?? cause.message) : String(cause),
      });
    },
    onNotReady({ checkpoint_id, report }) {
      logger.warn('prepare deadline passed before the participant was ready', {
        checkpoint_id,
        blocker_count: report.blocker_count,
        blockers: report.blockers,
      });
    },
    onPrepareAbandoned: (event) => logger.warn('prepare abandoned; reopening admission', event),
    onExportFailed: (event) => logger.error('export failed; the checkpoint cannot commit', event),
    onParkFailed: (event) => logger.warn('park_exported failed; ignored', event),
    onReopenFailed: (event) =>
      logger.error('reopening admission failed; the next resume retries it', event),
    onLeaseExpired: (event) => logger.warn('lease expired; aborting the checkpoint', event),
    onLeaseExpiryFailed: (event) => logger.error('lease expiry could not reopen; retrying', event),
  };
}

type Hook = keyof ControlObserver;

/**
 * One observer that tells each of `observers` in turn. An observer that throws is logged and
 * skipped: telemetry must never fail or stall a checkpoint.
 */
export function fanOut(observers: readonly ControlObserver[], logger: Logger): ControlObserver {
  const tell =
    <H extends Hook>(hook: H) =>
    (event: Parameters<NonNullable<ControlObserver[H]>>[0]): void => {
      for (const observer of observers) {
        try {
          (observer[hook] as ((e: typeof event) => void) | undefined)?.call(observer, event);
        } catch (err) {
          logger.error('a control observer failed; ignored', { hook, error: describe(err) });
        }
      }
    };
  return {
    onOperation: tell('onOperation'),
    onRefused: tell('onRefused'),
    onNotReady: tell('onNotReady'),
    onPrepareAbandoned: tell('onPrepareAbandoned'),
    onExportFailed: tell('onExportFailed'),
    onParkFailed: tell('onParkFailed'),
    onReopenFailed: tell('onReopenFailed'),
    onLeaseExpired: tell('onLeaseExpired'),
    onLeaseExpiryFailed: tell('onLeaseExpiryFailed'),
  };
}

/** What an operation reports at its end besides its timings. */
export interface OperationCounts {
  readonly episodes: number;
  readonly bytes?: number | undefined;
  readonly source_checkpoint_id?: string;
}

/**
 * One admitted operation being timed: its stages back to back (each runs from the end of the one
 * before, the first from the start, so they add up to the operation's time), then its outcome.
 */
export class OperationWatch {
  readonly #observer: ControlObserver;
  readonly #operation: ObservedOperation;
  readonly #checkpointId: string;
  readonly #phase: () => Phase;
  readonly #startedAt = performance.now();
  readonly #cpuAtStart = process.cpuUsage();
  #lastAt = this.#startedAt;
  #cpuAtLast = this.#cpuAtStart;
  readonly #stages: StageTiming[] = [];

  constructor(
    observer: ControlObserver,
    operation: ObservedOperation,
    checkpointId: string,
    phase: () => Phase,
  ) {
    this.#observer = observer;
    this.#operation = operation;
    this.#checkpointId = checkpointId;
    this.#phase = phase;
  }

  /** Stage `name` ended now. */
  lap(name: StageName): void {
    const at = performance.now();
    const cpu = process.cpuUsage();
    this.#stages.push({
      name,
      ms: elapsedMs(this.#lastAt, at),
      cpu_ms: cpuMs(this.#cpuAtLast, cpu),
    });
    this.#lastAt = at;
    this.#cpuAtLast = cpu;
  }

  /** Runs the operation's body and tells how it ended; the body returns its reply and counts. */
  async run<T>(body: () => Promise<{ reply: T; counts: OperationCounts }>): Promise<T> {
    try {
      const { reply, counts } = await body();
      this.succeeded(counts);
      return reply;
    } catch (err) {
      this.failed(err);
      throw err;
    }
  }

  succeeded(counts: OperationCounts): void {
    this.#end('ok', counts);
  }

  failed(err: unknown): void {
    this.#end(errorCode(err), { episodes: 0 });
  }

  #end(outcome: string, counts: OperationCounts): void {
    this.#observer.onOperation?.({
      operation: this.#operation,
      checkpoint_id: this.#checkpointId,
      outcome,
      phase: this.#phase(),
      stages: [...this.#stages],
      started_at: this.#startedAt,
      ms: elapsedMs(this.#startedAt, performance.now()),
      cpu_ms: cpuMs(this.#cpuAtStart, process.cpuUsage()),
      ...counts,
    });
  }
}

function elapsedMs(from: number, to: number): number {
  return Math.round(to - from);
}

/**
 * CPU the whole process used between two readings (every thread: the collector's helpers too, and
 * whatever else the process did meanwhile), in ms.
 */
function cpuMs(from: NodeJS.CpuUsage, to: NodeJS.CpuUsage): number {
  return Math.round((to.user - from.user + to.system - from.system) / 1000);
}
