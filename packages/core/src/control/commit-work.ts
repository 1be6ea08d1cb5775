/**
 * One checkpoint's commit work: export → records write → restored cleanup → park, each step kept
 * as a promise (`Kept`), so a retried commit awaits the same work instead of starting it again. The
 * export runs once: its cut stays the one taken at the first commit, and a failed export ends the
 * checkpoint for good. A failed write or cleanup is started again by the next commit, with the
 * same records.
 */
import {
  CheckpointError,
  DeadlineExceededError,
  ExportFailedError,
  RestartInScopeError,
} from '../errors.js';
import { captureKey, type EpisodeId } from '../identity.js';
import type { Participant } from '../participant.js';
import { type CheckpointRecord, type Manifest, WriteStop } from '../store.js';
import { CONTROL_CONCURRENCY, forEachBounded, Kept } from './deadline.js';
import { type ControlObserver, describe, type OperationWatch } from './observer.js';
import type { CallArgs } from './replay.js';

/** An export's records, with each one's capture key (in the same order), made once per commit. */
export interface Exported<R extends CheckpointRecord> {
  readonly records: R[];
  readonly keys: readonly string[];
}

/** Awaits a step within the commit's deadline (the step itself is kept running past it). */
export type Bound = <T>(work: Promise<T>) => Promise<T>;

export interface CommitWorkOptions<R extends CheckpointRecord> {
  readonly checkpointId: string;
  /** The commit's scope as the request named it, null for every episode. */
  readonly scope: readonly EpisodeId[] | null;
  readonly args: CallArgs;
  readonly participant: Participant<R>;
  /** Writes the records, then the manifest; once `stop` is stopped no manifest appears. */
  write(records: R[], stop: WriteStop): Promise<Manifest>;
  readonly observer: ControlObserver;
}

/** A scope may not name an episode that restarts: the restart replaces it. */
export function restartInScopeError(
  scopeKeys: ReadonlySet<string> | null,
  restarts: ReadonlySet<string>,
): RestartInScopeError | undefined {
  // Usually nothing restarts: a scope of thousands is then not copied to be searched.
  if (scopeKeys === null || restarts.size === 0) return undefined;
  const named = [...scopeKeys].filter((key) => restarts.has(key)).sort();
  if (named.length === 0) return undefined;
  return new RestartInScopeError(
    `the commit scope names episodes that restart: ${named.join(', ')}`,
  );
}

export class CommitWork<R extends CheckpointRecord> {
  /** The directory and scope of the commit that started it; a retry must match. */
  readonly args: CallArgs;
  readonly #options: CommitWorkOptions<R>;
  readonly #exportAbort = new AbortController();
  readonly #writeStop = new WriteStop();
  readonly #exported: Kept<Exported<R>>;
  #failure: string | null = null;
  #write: Kept<Manifest> | null = null;
  #cleanup: Kept<void> | null = null;
  #parked: Kept<void> | null = null;

  /** Starts the export now: a participant's export may do all its work synchronously. */
  constructor(options: CommitWorkOptions<R>) {
    this.#options = options;
    this.args = options.args;
    this.#exported = new Kept(() => this.#export());
    // Final even when it fails after its commit gave up waiting: a later export could take a later
    // cut than the other participants committed.
    this.#exported.promise.catch((err: unknown) => {
      if (this.#exportAbort.signal.aborted) return;
      const id = options.checkpointId;
      this.#failure = `the export of checkpoint ${id} failed: ${describe(err)}; resume and prepare again under a new checkpoint id`;
      options.observer.onExportFailed?.({ checkpoint_id: id, error: describe(err) });
    });
  }

  /** Why this checkpoint can never commit (its export failed), or null. */
  get failure(): string | null {
    return this.#failure;
  }

  /**
   * Awaits each step within `bound`, starting the ones not yet started (or a failed write or
   * cleanup again), and laps each on `watch`. With `stop`, the exported episodes are parked; a park
   * failure is reported and ignored: the checkpoint is already durable, and what stays held is
   * freed by resume or retire.
   */
  async run(
    bound: Bound,
    stop: boolean,
    watch: OperationWatch,
  ): Promise<Exported<R> & { manifest: Manifest }> {
    let exported: Exported<R>;
    try {
      exported = await bound(this.#exported.promise);
    } catch (err) {
      if (this.#exported.failed)
        throw new ExportFailedError(this.#failure ?? describe(err), { cause: err });
      throw err;
    }
    watch.lap('export');
    const { records } = exported;

    if (this.#write === null || this.#write.failed) {
      this.#write = new Kept(() => this.#options.write(records, this.#writeStop));
    }
    const manifest = await bound(this.#write.promise);
    watch.lap('records_write');

    const scopeKeys = this.args.scope;
    if (scopeKeys !== null) {
      if (this.#cleanup === null || this.#cleanup.failed) {
        this.#cleanup = new Kept(() => this.#deleteUnscopedRestored(scopeKeys));
      }
      await bound(this.#cleanup.promise);
      watch.lap('restored_cleanup');
    }

    if (stop) {
      this.#parked ??= new Kept(() => this.#options.participant.parkExported(records));
      try {
        await bound(this.#parked.promise);
        watch.lap('park');
      } catch (err) {
        const checkpoint_id = this.#options.checkpointId;
        this.#options.observer.onParkFailed?.({ checkpoint_id, error: describe(err) });
      }
    }
    return { ...exported, manifest };
  }

  /**
   * The checkpoint ends (resume or lease expiry): waits within `bound` for a cleanup still deleting
   * restored state (a replacement may start as that attempt), then cancels a running export and
   * stops the writer, so no manifest appears after this returns.
   */
  async end(bound: Bound, reason: string): Promise<void> {
    if (this.#cleanup?.running) {
      try {
        await bound(this.#cleanup.settled());
      } catch (err) {
        if (err instanceof DeadlineExceededError) {
          throw new DeadlineExceededError('restored state is still being deleted; resume again', {
            cause: err,
          });
        }
        throw err;
      }
    }
    this.cancelExport(reason);
    await this.#writeStop.stop();
  }

  cancelExport(reason: string): void {
    this.#exportAbort.abort(new Error(reason));
  }

  async #export(): Promise<Exported<R>> {
    const scopeKeys = this.args.scope;
    const records = await this.#options.participant.export(
      this.#options.scope,
      this.#exportAbort.signal,
    );
    const keys = records.map((r) => captureKey(r.episode_id));
    const outside = scopeKeys === null ? [] : keys.filter((k) => !scopeKeys.has(k));
    if (outside.length > 0) {
      throw new CheckpointError(
        `the participant exported episodes outside the commit scope: ${outside.slice(0, 10).join(', ')}`,
      );
    }
    return { records, keys };
  }

  /** Frees restored attempts the commit's scope does not continue; they are not marked retired. */
  async #deleteUnscopedRestored(scopeKeys: ReadonlySet<string>): Promise<void> {
    const participant = this.#options.participant;
    const unscoped = participant.restoredPending().filter((e) => !scopeKeys.has(captureKey(e)));
    await forEachBounded(unscoped, CONTROL_CONCURRENCY, (e) => participant.deleteRestored(e));
  }
}
