/**
 * The participant contract: what one server kind plugs into its process's control plane. The
 * control plane owns phases, fencing, deadlines, the lease and storage; a participant owns its
 * live work — admission, readiness, export, install, retire.
 */
import { captureKey, type EpisodeId } from './identity.js';
import type { JsonObject } from './json.js';
import type { CheckpointRecord, Manifest, RawRecord } from './store.js';

export type ParticipantKind = 'environment' | 'model' | 'agent' | 'resources';

/** Prepare order; resume runs it in reverse. */
export const PREPARE_ORDER: readonly ParticipantKind[] = [
  'environment',
  'model',
  'agent',
  'resources',
];
/** Retire and forget: callers before the servers they call. */
export const RETIRE_ORDER: readonly (readonly ParticipantKind[])[] = [
  ['environment'],
  ['agent'],
  ['model', 'resources'],
];

export function isParticipantKind(value: unknown): value is ParticipantKind {
  return typeof value === 'string' && (PREPARE_ORDER as readonly string[]).includes(value);
}

export const MAX_REPORTED_BLOCKERS = 100;

export interface PrepareReport {
  ready: boolean;
  /** Capture keys still between boundaries; at most MAX_REPORTED_BLOCKERS listed. */
  blockers: string[];
  blocker_count: number;
  counts: Record<string, number>;
  /** In-flight episodes this participant cannot capture: never capped, never blocking. */
  restarts: string[];
}

/** Builds a report, listing at most MAX_REPORTED_BLOCKERS blockers out of `blockerCount`. */
export function prepareReport(parts: {
  blockers: Iterable<string>;
  blockerCount: number;
  counts?: Record<string, number>;
  restarts?: Iterable<string>;
}): PrepareReport {
  const blockers: string[] = [];
  for (const key of parts.blockers) {
    if (blockers.length >= MAX_REPORTED_BLOCKERS) break;
    blockers.push(key);
  }
  return {
    ready: parts.blockerCount === 0,
    blockers,
    blocker_count: parts.blockerCount,
    counts: parts.counts ?? {},
    restarts: [...(parts.restarts ?? [])],
  };
}

export interface AdmissionRequest {
  checkpointId: string;
  deadlineTs: number;
  /**
   * Restarts earlier prepare stages reported: never waited for and never exported here. A live
   * set: a repeated prepare of the same checkpoint may add to it; it ends with openAdmission.
   */
  carriedRestarts: ReadonlySet<string>;
}

/**
 * Retired marks: per rollout, the highest retired attempt. Never lowered; only forget removes a
 * rollout's entry. Data-plane requests of a marked attempt (attempt ≤ mark) are `stale_attempt`.
 */
export class RetiredMarks {
  private readonly highest = new Map<string, number>();

  /** Raises the marks to cover `episodes`; returns how many episodes were given. */
  mark(episodes: Iterable<EpisodeId>): number {
    let count = 0;
    for (const e of episodes) {
      count += 1;
      const current = this.highest.get(e.rollout_id);
      if (current === undefined || e.attempt > current) this.highest.set(e.rollout_id, e.attempt);
    }
    return count;
  }

  isRetired(e: EpisodeId): boolean {
    const mark = this.highest.get(e.rollout_id);
    return mark !== undefined && e.attempt <= mark;
  }

  highestRetired(rolloutId: string): number | undefined {
    return this.highest.get(rolloutId);
  }

  /** Removes the marks of `rolloutIds`; returns how many rollouts had one. */
  forget(rolloutIds: Iterable<string>): number {
    let count = 0;
    for (const id of new Set(rolloutIds)) if (this.highest.delete(id)) count += 1;
    return count;
  }

  get size(): number {
    return this.highest.size;
  }

  rollouts(): IterableIterator<string> {
    return this.highest.keys();
  }
}

/**
 * One server's side of the protocol. The control plane calls these hooks under its transition
 * lock; `ready()` is called often and must be cheap (running counts, never a scan).
 */
export interface Participant<R extends CheckpointRecord = CheckpointRecord> {
  readonly kind: ParticipantKind;
  /** The server's instance name; it names the participant's directory in a checkpoint. */
  readonly instance: string;
  /** The marks refusing retired attempts; the control plane raises them, the data plane reads them. */
  readonly marks: RetiredMarks;

  /** Stops new work and makes in-flight work park at its next boundary. Honours the deadline itself. */
  closeAdmission(request: AdmissionRequest): Promise<void>;
  /**
   * A model server's generation-cut round, once admission closed (prepare and restore): separate
   * from `closeAdmission` so the plane times it as its own stage, `cut_round`.
   */
  cutRound?(request: AdmissionRequest): Promise<void>;
  /** Reopens admission and releases parked work; also ends carried restarts. */
  openAdmission(): Promise<void>;
  /** True when nothing is between boundaries. Cheap. */
  ready(): boolean;
  /** The full report, listing blockers; called once per reply, never in a loop. */
  readiness(): PrepareReport;
  /** Subscribes to readiness changes; returns the unsubscribe function. */
  onChange(listener: () => void): () => void;

  /**
   * The records of the episodes this checkpoint continues: live parked episodes in `scope` and
   * unclaimed restored episodes whose replacement attempt is in `scope` (all of them when `scope`
   * is null). Exported state must not change until resume.
   */
  export(scope: readonly EpisodeId[] | null, signal: AbortSignal): Promise<R[]>;
  /** Validates one record read back at restore (only records in scope are validated). */
  validateRecord(record: JsonObject, key: string): R;
  /**
   * `validateRecord` on a record read back undecoded: when present, restore reads through
   * `readRawParticipantState` (the store still verifies the whole checkpoint first) and the
   * participant decodes the fields it needs now, keeping its opaque payload until first use (a
   * record under `DEFER_DECODE_MIN_BYTES` is decoded whole at once).
   */
  validateRawRecord?(record: RawRecord, key: string): R;
  /** Refuses a restore this participant cannot take (throws a typed error). */
  checkRestore(): void;
  /**
   * Installs checkpointed records under each one's next attempt. `scope` names every episode the
   * restore continues, with or without a record here. Validates everything before changing anything.
   */
  install(records: R[], scope: readonly EpisodeId[]): Promise<void>;
  /** Replacement attempts installed by a restore and not yet claimed by a request. */
  restoredPending(): EpisodeId[];
  /** Frees an unclaimed restored attempt without leaving anything that refuses it later. */
  deleteRestored(episode: EpisodeId): Promise<void>;
  /** Stops the attempt and its earlier ones, waits for them to end, frees their state. */
  retire(episode: EpisodeId): Promise<void>;
  /** After a commit with `stop`: frees what exported state holds outside the process. */
  parkExported(records: R[]): Promise<void>;
  /** Refuses (`retire_incomplete`) a forget that would drop the mark of a rollout still holding state. */
  checkForget(rolloutIds: readonly string[]): void;

  statusExtra(): Record<string, unknown>;
  /** Extra manifest keys; they may not override the base keys. */
  manifestExtra(): Record<string, unknown>;
  /** Reads back what `manifestExtra` wrote: called by a restore before `install`. */
  restoreManifest?(manifest: Manifest): void;
  /** Extra commit reply keys (the policy model adds staging keys). */
  commitReplyExtra(records: R[]): Record<string, unknown>;
}

/**
 * Defaults for the optional hooks, and change notifications. A concrete participant extends it
 * and implements admission, readiness, export, install and retire.
 */
export abstract class BaseParticipant<
  R extends CheckpointRecord = CheckpointRecord,
> implements Participant<R> {
  readonly marks = new RetiredMarks();
  private readonly listeners = new Set<() => void>();

  constructor(
    readonly kind: ParticipantKind,
    readonly instance: string,
  ) {}

  abstract closeAdmission(request: AdmissionRequest): Promise<void>;
  abstract openAdmission(): Promise<void>;
  abstract ready(): boolean;
  abstract readiness(): PrepareReport;
  abstract export(scope: readonly EpisodeId[] | null, signal: AbortSignal): Promise<R[]>;
  abstract validateRecord(record: JsonObject, key: string): R;
  abstract install(records: R[], scope: readonly EpisodeId[]): Promise<void>;
  abstract restoredPending(): EpisodeId[];
  abstract retire(episode: EpisodeId): Promise<void>;

  onChange(listener: () => void): () => void {
    this.listeners.add(listener);
    return () => this.listeners.delete(listener);
  }

  /** Wakes the readiness wait; call whenever readiness may have changed. */
  protected notifyChange(): void {
    for (const listener of this.listeners) listener();
  }

  checkRestore(): void {}

  /** Default: free like retire; the control plane raises no mark for a deleted restored attempt. */
  deleteRestored(episode: EpisodeId): Promise<void> {
    return this.retire(episode);
  }

  async parkExported(_records: R[]): Promise<void> {}

  checkForget(_rolloutIds: readonly string[]): void {}

  statusExtra(): Record<string, unknown> {
    return {};
  }

  manifestExtra(): Record<string, unknown> {
    return {};
  }

  commitReplyExtra(_records: R[]): Record<string, unknown> {
    return {};
  }
}

/** Capture keys of `episodes`, sorted (how scopes are compared and replied). */
export function sortedKeys(episodes: Iterable<EpisodeId>): string[] {
  return [...episodes].map(captureKey).sort();
}
