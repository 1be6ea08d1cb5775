/**
 * The status reply's `last_checkpoint`: the operations of the latest checkpoint this plane ran,
 * each with its outcome and where its time went, so an operator (`ckpt-gym status --watch`) sees
 * what the last prepare, commit or restore cost without reading the logs. A `ControlObserver` the
 * plane registers by default.
 */
import type {
  ControlObserver,
  ObservedOperation,
  OperationEvent,
  StageTiming,
} from './observer.js';

/** One operation of the checkpoint, as it ended. */
export interface LastOperation {
  /** 'ok', or the stable code of the error it failed with. */
  readonly outcome: string;
  /** When it ended, in the plane's clock (seconds since the Unix epoch). */
  readonly ended_at: number;
  /** Wall time and process CPU of the whole operation, ms. */
  readonly ms: number;
  readonly cpu_ms: number;
  /** The stages that ended, in order. */
  readonly stages: readonly StageTiming[];
  readonly episodes: number;
  readonly bytes?: number;
}

/** The latest checkpoint's operations; a repeated operation (a second prepare) replaces the first. */
export interface LastCheckpoint {
  readonly checkpoint_id: string;
  readonly operations: Readonly<Partial<Record<ObservedOperation, LastOperation>>>;
}

/** What `last` becomes once `event` ended at `endedAt`: a new checkpoint id starts afresh. */
export function withOperation(
  last: LastCheckpoint | null,
  event: OperationEvent,
  endedAt: number,
): LastCheckpoint {
  const earlier = last?.checkpoint_id === event.checkpoint_id ? last.operations : {};
  const operation: LastOperation = {
    outcome: event.outcome,
    ended_at: endedAt,
    ms: event.ms,
    cpu_ms: event.cpu_ms,
    stages: event.stages,
    episodes: event.episodes,
    ...(event.bytes === undefined ? {} : { bytes: event.bytes }),
  };
  return {
    checkpoint_id: event.checkpoint_id,
    operations: { ...earlier, [event.operation]: operation },
  };
}

/** Keeps the latest checkpoint's operations for the status reply. */
export class LastCheckpointObserver implements ControlObserver {
  readonly #now: () => number;
  #last: LastCheckpoint | null = null;

  constructor(now: () => number) {
    this.#now = now;
  }

  onOperation(event: OperationEvent): void {
    this.#last = withOperation(this.#last, event, this.#now());
  }

  /** Null until the plane has run an operation. */
  get last(): LastCheckpoint | null {
    return this.#last;
  }
}
