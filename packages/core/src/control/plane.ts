/**
 * The control plane: one per server process, wrapping that server's participant. It is the lock
 * and the dispatch of the checkpoint protocol: each control call runs under one mutex, is admitted
 * by the phase rules (`phases.ts`), does its work and moves the phase. Its mechanics live beside
 * it: the lease (`lease.ts`), the replies replayed to retries and the resumed-id memory
 * (`replay.ts`), a checkpoint's commit work (`commit-work.ts`) and what the plane reports
 * (`observer.ts`, which also writes its log lines). The participant owns its live work.
 *
 * Work that must not be cut short by a deadline — the export, the records write, the deletion of
 * unscoped restored state and the install — is kept as a promise: a retry or a resume awaits the
 * same work instead of starting it again, so a checkpoint exports once and its cut stays the one
 * taken at its first commit.
 */
import {
  CheckpointConflictError,
  CheckpointError,
  CkptGymError,
  DeadlineExceededError,
  ExportFailedError,
} from '../errors.js';
import { captureKey, type EpisodeId, nextAttempt } from '../identity.js';
import { createLogger, type Logger } from '../logging.js';
import { Mutex } from '../mutex.js';
import type { Participant } from '../participant.js';
import type { CheckpointRecord } from '../store.js';
import { type Bound, CommitWork, restartInScopeError } from './commit-work.js';
import {
  CONTROL_CONCURRENCY,
  type ControlClock,
  forEachBounded,
  type Kept,
  systemClock,
  withinDeadline,
} from './deadline.js';
import { LastCheckpointObserver } from './last-checkpoint.js';
import { Lease } from './lease.js';
import {
  type ControlObserver,
  describe,
  fanOut,
  logObserver,
  type ObservedOperation,
  OperationWatch,
} from './observer.js';
import {
  admissionError,
  type FencedOperation,
  outsideCheckpointError,
  type Phase,
  resumeAction,
} from './phases.js';
import { ReadinessWaits } from './readiness.js';
import {
  type CallArgs,
  callArgs,
  PREPARE_ARGS,
  RecentIds,
  RecordedReplies,
  sameArgs,
} from './replay.js';
import { Installs, readAndInstall, runCutRound } from './restore-work.js';
import type {
  CommitReply,
  PrepareReply,
  RestoreReply,
  ResumeReply,
  StatusReply,
} from './replies.js';
import type {
  CheckpointRequest,
  CommitRequest,
  ForgetRequest,
  PrepareRequest,
  RestoreRequest,
  RetireRequest,
} from './schemas.js';
import { ParticipantStorage, type ParticipantStorageOptions } from './storage.js';

export { CONTROL_CONCURRENCY } from './deadline.js';

/** Enough to refuse a stale controller's delayed request: it retries within moments. */
export const RESUMED_IDS_KEPT = 64;
/** After a lease expiry's reopen failed, it is tried again this long after. */
export const LEASE_RETRY_SECONDS = 30;

export interface ControlPlaneOptions extends ParticipantStorageOptions {
  /** How long past a control call's deadline the participant stays closed without hearing from the controller. */
  leaseGraceSeconds: number;
  clock?: ControlClock;
  /** Default LEASE_RETRY_SECONDS. */
  leaseRetrySeconds?: number;
  logger?: Logger;
  /**
   * Told of every operation, refusal and lease expiry, after the plane's log lines (`logObserver`)
   * and its status reply's `last_checkpoint`.
   */
  observers?: readonly ControlObserver[];
}

/** The operations whose replies a retry with the same arguments gets again. */
type ReplayedReplies = {
  prepare: PrepareReply;
  commit: CommitReply;
  restore: RestoreReply;
};

/** One episode per rollout, at its latest attempt: retiring it stops the earlier ones too. */
function latestPerRollout(episodes: readonly EpisodeId[]): EpisodeId[] {
  const latest = new Map<string, EpisodeId>();
  for (const e of episodes) {
    const current = latest.get(e.rollout_id);
    if (current === undefined || e.attempt > current.attempt) latest.set(e.rollout_id, e);
  }
  return [...latest.values()];
}

/** Merges a participant's extra reply keys after the base keys; an extra may not replace one. */
function withExtra<T extends object>(base: T, extra: Record<string, unknown>, what: string): T {
  for (const key of Object.keys(extra)) {
    if (Object.hasOwn(base, key))
      throw new CheckpointError(`${what} key '${key}' would replace a base key`);
  }
  return { ...base, ...extra };
}

export class ControlPlane<R extends CheckpointRecord = CheckpointRecord> {
  readonly participant: Participant<R>;
  readonly #clock: ControlClock;
  readonly #leaseGraceSeconds: number;
  readonly #leaseRetrySeconds: number;
  readonly #observer: ControlObserver;
  readonly #lastCheckpoint: LastCheckpointObserver;
  readonly #storage: ParticipantStorage<R>;
  readonly #lock = new Mutex();
  readonly #resumed = new RecentIds(RESUMED_IDS_KEPT);
  readonly #replies = new RecordedReplies<ReplayedReplies>();
  readonly #readiness: ReadinessWaits;
  readonly #installs = new Installs();

  #phase: Phase = 'idle';
  #checkpointId: string | null = null;
  /** The open checkpoint's lease, from its first renewal until it ends. */
  #lease: Lease | null = null;
  #carriedRestarts = new Set<string>();
  #work: CommitWork<R> | null = null;
  /** Why the open checkpoint can never commit: its readiness regressed before the export. */
  #finalFailure: string | null = null;
  /** Admission was left closed with no checkpoint open (a failed restore or prepare rollback). */
  #reopenPending = false;
  #disposed = false;

  constructor(participant: Participant<R>, options: ControlPlaneOptions) {
    if (!(options.leaseGraceSeconds > 0)) {
      throw new RangeError(`leaseGraceSeconds must be > 0, got ${options.leaseGraceSeconds}`);
    }
    this.participant = participant;
    this.#clock = options.clock ?? systemClock;
    this.#leaseGraceSeconds = options.leaseGraceSeconds;
    this.#leaseRetrySeconds = options.leaseRetrySeconds ?? LEASE_RETRY_SECONDS;
    const logger = (
      options.logger ?? createLogger({ server: participant.instance, kind: participant.kind })
    ).child({ component: 'control-plane' });
    this.#lastCheckpoint = new LastCheckpointObserver(() => this.#clock.now());
    this.#observer = fanOut(
      [logObserver(logger), this.#lastCheckpoint, ...(options.observers ?? [])],
      logger,
    );
    this.#storage = new ParticipantStorage(participant, options);
    this.#readiness = new ReadinessWaits(this.#clock);
  }

  // --- status and renew -----------------------------------------------------------------------

  status(): StatusReply {
    return this.#guard('status', () =>
      withExtra(
        {
          kind: this.participant.kind,
          instance: this.participant.instance,
          phase: this.#phase,
          checkpoint_id: this.#checkpointId,
          lease_expires_at: this.#lease?.expiresAt ?? null,
          retired_rollouts: this.participant.marks.size,
          report: this.participant.readiness(),
          last_checkpoint: this.#lastCheckpoint.last,
        } as StatusReply,
        this.participant.statusExtra(),
        'status',
      ),
    );
  }

  renew(req: CheckpointRequest): Promise<{ lease_expires_at: number }> {
    return this.#transition('renew', req.checkpoint_id, async () => {
      this.#admit('renew', req.checkpoint_id);
      return { lease_expires_at: this.#renewLease(req.deadline_ts) };
    });
  }

  // --- prepare ----------------------------------------------------------------------------------

  /**
   * Closes admission and waits, outside the lock, until the participant is ready, the deadline
   * passes or the checkpoint changes. Not ready at the deadline is not an error: the reply says
   * `preparing` with the blockers and admission stays closed.
   */
  async prepare(req: PrepareRequest, signal?: AbortSignal): Promise<PrepareReply> {
    const id = req.checkpoint_id;
    const started = await this.#transition('prepare', id, async () => {
      const earlier = this.#replies.replay('prepare', id, PREPARE_ARGS);
      if (earlier) return earlier;
      this.#admit('prepare', id);
      // A deadline already passed leaves no time to get ready: refused before admission closes.
      if (this.#clock.now() >= req.deadline_ts) throw new DeadlineExceededError('deadline passed');
      const watch = this.#watch('prepare', id);
      if (this.#phase === 'idle') {
        await this.#openCheckpoint(req, watch);
      } else {
        // A repeated prepare may carry more restarts; the participant holds the live set.
        for (const key of req.restarts ?? []) this.#carriedRestarts.add(key);
        this.#renewLease(req.deadline_ts);
      }
      return watch;
    });
    if (!(started instanceof OperationWatch)) return started;
    const watch = started;

    try {
      const changed = (): boolean =>
        this.#disposed || this.#phase !== 'preparing' || this.#checkpointId !== id;
      await this.#readiness.wait(this.participant, changed, req.deadline_ts, signal);
      watch.lap('readiness_wait');
    } catch (err) {
      await this.#lock.run(async () => {
        if (this.#phase === 'preparing' && this.#checkpointId === id) {
          await this.#abandonPrepare(`the readiness wait ended: ${describe(err)}`);
        }
      });
      watch.failed(err);
      throw this.#typed('prepare', id, err);
    }

    return this.#transition('prepare', id, () =>
      watch.run(async () => ({
        reply:
          this.#replies.replay('prepare', id, PREPARE_ARGS) ??
          this.#settlePrepare(id, req.deadline_ts),
        counts: { episodes: 0 },
      })),
    );
  }

  /** The first prepare of a checkpoint: enters `preparing`, takes the lease, closes admission. */
  async #openCheckpoint(req: PrepareRequest, watch: OperationWatch): Promise<void> {
    const id = req.checkpoint_id;
    this.#carriedRestarts = new Set(req.restarts ?? []);
    this.#enter('preparing', id);
    this.#renewLease(req.deadline_ts);
    try {
      const admission = {
        checkpointId: id,
        deadlineTs: req.deadline_ts,
        carriedRestarts: this.#carriedRestarts,
      };
      await this.participant.closeAdmission(admission);
      watch.lap('close_admission');
      await runCutRound(this.participant, admission, watch);
    } catch (err) {
      await this.#abandonPrepare('closing admission failed');
      watch.failed(err);
      throw err;
    }
  }

  /** After the wait: `prepared` when ready (recorded for replay), else the blockers. */
  #settlePrepare(id: string, deadlineTs: number): PrepareReply {
    // The single listing of blockers, for the reply.
    const report = this.participant.readiness();
    if (this.#phase !== 'preparing' || this.#checkpointId !== id)
      return { phase: this.#phase, report };
    if (!report.ready) {
      if (this.#clock.now() >= deadlineTs)
        this.#observer.onNotReady?.({ checkpoint_id: id, report });
      return { phase: 'preparing', report };
    }
    this.#phase = 'prepared';
    this.#readiness.wakeAll();
    const reply: PrepareReply = { phase: 'prepared', report };
    this.#replies.record('prepare', id, PREPARE_ARGS, reply);
    return reply;
  }

  /** Ends a prepare that could not finish, without fencing its id (the controller may retry it). */
  async #abandonPrepare(reason: string): Promise<void> {
    this.#observer.onPrepareAbandoned?.({ checkpoint_id: this.#checkpointId, reason });
    this.#leave();
    await this.#finishPendingReopen();
  }

  // --- commit -----------------------------------------------------------------------------------

  commit(req: CommitRequest, signal?: AbortSignal): Promise<CommitReply> {
    const id = req.checkpoint_id;
    return this.#replayOrAdmit('commit', req, async (args) => {
      this.#renewLease(req.deadline_ts);
      const failure = this.#finalFailure ?? this.#work?.failure ?? null;
      if (failure !== null) throw new ExportFailedError(failure);

      const watch = this.#watch('commit', id);
      return watch.run(async () => {
        const work = this.#commitWork(req, args);
        const bound = this.#bound(req.deadline_ts, signal);
        const { records, keys, manifest } = await work.run(bound, req.stop, watch);
        const reply = withExtra(
          {
            phase: 'committed' as const,
            manifest,
            episode_ids: [...new Set(keys)].sort(),
          },
          this.participant.commitReplyExtra(records),
          'commit reply',
        );
        this.#phase = 'committed';
        this.#readiness.wakeAll();
        this.#replies.record('commit', id, args, reply);
        return { reply, counts: { episodes: records.length, bytes: manifest.records_bytes } };
      });
    });
  }

  /**
   * The checkpoint's commit work: the one a first commit started (a retry must name the same
   * directory and scope), or new. New work needs readiness to still hold (a regression before the
   * export started ends the checkpoint for good) and a scope naming no restart.
   */
  #commitWork(req: CommitRequest, args: CallArgs): CommitWork<R> {
    const id = req.checkpoint_id;
    if (this.#work !== null) {
      if (sameArgs(this.#work.args, args)) return this.#work;
      throw new CheckpointConflictError(
        `checkpoint ${id} is already being written to another directory or scope`,
      );
    }
    if (!this.participant.ready()) {
      const report = this.participant.readiness();
      this.#finalFailure =
        `participant is no longer ready to commit checkpoint ${id} ` +
        `(blockers=${JSON.stringify(report.blockers)}); resume and prepare again under a new checkpoint id`;
      throw new ExportFailedError(this.#finalFailure);
    }
    if (args.scope !== null) {
      const restarts = [...this.participant.readiness().restarts, ...this.#carriedRestarts];
      const refusal = restartInScopeError(args.scope, new Set(restarts));
      if (refusal) throw refusal;
    }
    this.#work = new CommitWork({
      checkpointId: id,
      scope: req.episode_ids,
      args,
      participant: this.participant,
      observer: this.#observer,
      write: (records, stop) => this.#storage.write(req.checkpoint_dir, id, records, stop),
    });
    return this.#work;
  }

  // --- restore ----------------------------------------------------------------------------------

  restore(req: RestoreRequest, signal?: AbortSignal): Promise<RestoreReply> {
    const id = req.checkpoint_id;
    return this.#replayOrAdmit('restore', req, async (args) => {
      this.participant.checkRestore();

      const watch = this.#watch('restore', id);
      return watch.run(async () => {
        const { source, records } = await readAndInstall(req, args.scope ?? new Set(), {
          participant: this.participant,
          storage: this.#storage,
          installs: this.#installs,
          bound: this.#bound(req.deadline_ts, signal),
          watch,
          rollBack: (generation, install) => this.#rollBackRestore(generation, install),
        });
        this.#enter('restored', id);
        this.#renewLease(req.deadline_ts);
        const reply: RestoreReply = {
          phase: 'restored',
          source_checkpoint_id: source.checkpoint_id,
          restored: records.map((r) => captureKey(nextAttempt(r.episode_id))).sort(),
        };
        this.#replies.record('restore', id, args, reply);
        const counts = { episodes: records.length, bytes: source.records_bytes };
        return { reply, counts: { ...counts, source_checkpoint_id: source.checkpoint_id } };
      });
    });
  }

  /**
   * Reopens admission after a failed restore: now, or — when its install still runs — once that
   * install ended, unless a later restore or a checkpoint took over by then.
   */
  async #rollBackRestore(generation: number, install: Kept<void> | null): Promise<void> {
    this.#reopenPending = true;
    if (install === null || !install.running) {
      await this.#finishPendingReopen();
      return;
    }
    void install.settled().then(() =>
      this.#lock.run(async () => {
        if (this.#phase === 'idle' && this.#installs.isLatest(generation) && this.#reopenPending) {
          await this.#finishPendingReopen();
        }
      }),
    );
  }

  /** A reopen that fails stays pending; the next resume retries it. */
  async #finishPendingReopen(): Promise<void> {
    try {
      await this.#reopenAdmission();
    } catch (err) {
      this.#observer.onReopenFailed?.({ error: describe(err) });
    }
  }

  async #reopenAdmission(): Promise<void> {
    this.#reopenPending = true;
    await this.participant.openAdmission();
    this.#reopenPending = false;
  }

  // --- retire and forget ------------------------------------------------------------------------

  /**
   * Marks the attempts first (kept past the deadline and on failure), waits for a running install
   * (it may be installing what this retire frees), then stops each rollout once, through its latest
   * attempt, a bounded number at a time, within the deadline.
   */
  retire(req: RetireRequest, signal?: AbortSignal): Promise<{ retired_count: number }> {
    const id = req.checkpoint_id;
    return this.#transition('retire', id, async () => {
      this.#admitOutside('retire', id);
      const retiredCount = this.participant.marks.mark(req.episode_ids);
      if (this.#phase === 'restored') this.#renewLease(req.deadline_ts);
      const watch = this.#watch('retire', id);
      return watch.run(async () => {
        await this.#retireRollouts(req, signal, watch);
        return { reply: { retired_count: retiredCount }, counts: { episodes: retiredCount } };
      });
    });
  }

  async #retireRollouts(
    req: RetireRequest,
    signal: AbortSignal | undefined,
    watch: OperationWatch,
  ): Promise<void> {
    const install = this.#installs.running;
    const stopStarting = new AbortController();
    const retireEach = async (): Promise<void> => {
      if (install) {
        await install.settled();
        watch.lap('install_wait');
      }
      const episodes = latestPerRollout(req.episode_ids);
      const retire = (e: EpisodeId): Promise<void> => this.participant.retire(e);
      await forEachBounded(episodes, CONTROL_CONCURRENCY, retire, stopStarting.signal);
      watch.lap('retire_drain');
    };
    try {
      await this.#bound(req.deadline_ts, signal)(retireEach());
    } finally {
      stopStarting.abort();
    }
  }

  forget(req: ForgetRequest): Promise<{ forgotten_count: number }> {
    return this.#transition('forget', req.checkpoint_id, async () => {
      this.#admitOutside('forget', req.checkpoint_id);
      this.participant.checkForget(req.rollout_ids);
      const forgottenCount = this.participant.marks.forget(req.rollout_ids);
      if (this.#phase === 'restored') this.#renewLease(req.deadline_ts);
      return { forgotten_count: forgottenCount };
    });
  }

  // --- resume and lease expiry ------------------------------------------------------------------

  resume(req: CheckpointRequest, signal?: AbortSignal): Promise<ResumeReply> {
    const id = req.checkpoint_id;
    return this.#transition('resume', id, async () => {
      const isResumed = (x: string): boolean => this.#resumed.has(x);
      const action = resumeAction(this.#state(), id, isResumed, this.#reopenPending);
      if (action instanceof CkptGymError) throw action;
      if (action === 'idempotent') {
        // Remembered even when nothing was open, so a delayed prepare of this id is fenced.
        this.#resumed.add(id);
        return { phase: 'idle', idempotent: true };
      }
      if (action === 'finish-reopen') {
        const install = this.#installs.running;
        if (install) await this.#bound(req.deadline_ts, signal)(install.settled());
        await this.#reopenAdmission();
        this.#resumed.add(id);
        this.#readiness.wakeAll();
        return { phase: 'idle', idempotent: false };
      }
      await this.#end(req.deadline_ts, signal);
      return { phase: 'idle', idempotent: false };
    });
  }

  /**
   * Ends the open checkpoint (resume or lease expiry): ends its commit work (see CommitWork.end),
   * reopens admission, fences the id. Any failure keeps the phase, so the resume can be retried.
   */
  async #end(deadlineTs: number, signal?: AbortSignal): Promise<void> {
    await this.#work?.end(this.#bound(deadlineTs, signal), 'the checkpoint was resumed');
    await this.#reopenAdmission();
    this.#resumed.add(this.#checkpointId as string);
    this.#leave();
  }

  /** The open checkpoint's lease, made at its first renewal. */
  #renewLease(deadlineTs: number): number {
    if (this.#lease === null) {
      const lease: Lease = new Lease(this.#clock, this.#leaseGraceSeconds, () =>
        this.#onLeaseExpiry(lease),
      );
      // A disposed plane arms no timer.
      if (this.#disposed) lease.end();
      this.#lease = lease;
    }
    return this.#lease.renew(deadlineTs);
  }

  /** Under the lock, unless renewed meanwhile: ends the checkpoint; a failure tries again later. */
  #onLeaseExpiry(lease: Lease): void {
    void this.#lock.run(async () => {
      if (this.#disposed || this.#lease !== lease || !lease.isExpired()) return;
      // A lease exists only while a checkpoint is open.
      const id = this.#checkpointId as string;
      this.#observer.onLeaseExpired?.({ checkpoint_id: id, phase: this.#phase });
      try {
        await this.#end(this.#clock.now() + this.#leaseRetrySeconds);
      } catch (err) {
        const retry_seconds = this.#leaseRetrySeconds;
        this.#observer.onLeaseExpiryFailed?.({
          checkpoint_id: id,
          retry_seconds,
          error: describe(err),
        });
        if (!this.#disposed && this.#lease === lease) lease.retryIn(retry_seconds);
      }
    });
  }

  /** Stops the lease timers and any running export; the plane takes no further part. */
  dispose(): void {
    this.#disposed = true;
    this.#lease?.end();
    this.#work?.cancelExport('the control plane was disposed');
    this.#readiness.wakeAll();
  }

  // --- shared steps -----------------------------------------------------------------------------

  #state(): { phase: Phase; checkpointId: string | null } {
    return { phase: this.#phase, checkpointId: this.#checkpointId };
  }

  #admit(op: FencedOperation, checkpointId: string): void {
    const refusal = admissionError(op, this.#state(), checkpointId, (id) => this.#resumed.has(id));
    if (refusal) throw refusal;
  }

  /**
   * A commit or restore under the lock: the reply it already gave for the same directory and
   * scope, or `run` once the call is admitted.
   */
  #replayOrAdmit<K extends 'commit' | 'restore'>(
    op: K,
    req: CommitRequest | RestoreRequest,
    run: (args: CallArgs) => Promise<ReplayedReplies[K]>,
  ): Promise<ReplayedReplies[K]> {
    const id = req.checkpoint_id;
    return this.#transition(op, id, async () => {
      const args = callArgs(req.checkpoint_dir, req.episode_ids);
      const earlier = this.#replies.replay(op, id, args);
      if (earlier) return earlier;
      this.#admit(op, id);
      return run(args);
    });
  }

  #admitOutside(op: 'retire' | 'forget', checkpointId: string): void {
    const refusal = outsideCheckpointError(op, this.#state(), checkpointId);
    if (refusal) throw refusal;
  }

  #watch(op: ObservedOperation, checkpointId: string): OperationWatch {
    return new OperationWatch(this.#observer, op, checkpointId, () => this.#phase);
  }

  /** Awaits work within the call's deadline (the work itself is not stopped) or until the client left. */
  #bound(deadlineTs: number, signal: AbortSignal | undefined): Bound {
    return (work) => withinDeadline(work, deadlineTs, { clock: this.#clock, signal });
  }

  #enter(phase: Phase, checkpointId: string): void {
    this.#phase = phase;
    this.#checkpointId = checkpointId;
    // Admission is closed by this checkpoint now; its resume or expiry reopens it.
    this.#reopenPending = false;
    this.#readiness.wakeAll();
  }

  /** Back to idle: drops the checkpoint's lease, results, work and carried restarts. */
  #leave(): void {
    this.#phase = 'idle';
    this.#checkpointId = null;
    this.#lease?.end();
    this.#lease = null;
    this.#replies.clear();
    this.#work = null;
    this.#finalFailure = null;
    this.#carriedRestarts = new Set();
    this.#readiness.wakeAll();
  }

  /** Runs a transition under the lock; anything untyped a hook throws becomes `checkpoint_error`. */
  async #transition<T>(op: string, checkpointId: string, fn: () => Promise<T>): Promise<T> {
    try {
      return await this.#lock.run(fn);
    } catch (err) {
      throw this.#typed(op, checkpointId, err);
    }
  }

  #guard<T>(op: string, fn: () => T): T {
    try {
      return fn();
    } catch (err) {
      throw this.#typed(op, null, err);
    }
  }

  /** The error a call answers with; the observer hears of each (and of the untyped original). */
  #typed(op: string, checkpointId: string | null, err: unknown): CkptGymError {
    const typed =
      err instanceof CkptGymError
        ? err
        : new CheckpointError(`checkpoint ${op} failed: ${describe(err)}`, { cause: err });
    this.#observer.onRefused?.({
      operation: op,
      checkpoint_id: checkpointId,
      code: typed.code,
      detail: typed.message,
      ...(typed === err ? {} : { cause: err }),
    });
    return typed;
  }
}
