/**
 * The control plane: one per server process, wrapping that server's participant. It owns the
 * phase machine, checkpoint-id fencing, the readiness wait, deadline-bounded work, the lease, the
 * resumed-id memory, result replay and manifest-last storage. The participant owns its live work.
 *
 * Work that must not be cut short by a deadline — the export, the records write, the deletion of
 * unscoped restored state and the install — is kept as a promise: a retry or a resume awaits the
 * same work instead of starting it again, so a checkpoint exports once and its cut stays the one
 * taken at its first commit.
 */
import {
  CheckpointConflictError,
  CheckpointError,
  CheckpointStateError,
  CkptGymError,
  DeadlineExceededError,
  ExportFailedError,
  RestartInScopeError,
} from '../errors.js';
import { captureKey, type EpisodeId, nextAttempt } from '../identity.js';
import { createLogger, type Logger } from '../logging.js';
import { Mutex } from '../mutex.js';
import type { Participant, PrepareReport } from '../participant.js';
import {
  type CheckpointRecord,
  type Manifest,
  readParticipantState,
  WriteStop,
  writeParticipantState,
} from '../store.js';
import {
  atTime,
  type ControlClock,
  forEachBounded,
  Kept,
  systemClock,
  withinDeadline,
} from './deadline.js';
import {
  admissionError,
  extendedLease,
  type FencedOperation,
  outsideCheckpointError,
  type Phase,
  resumeAction,
} from './phases.js';
import type {
  CheckpointRequest,
  CommitRequest,
  ForgetRequest,
  PrepareRequest,
  RestoreRequest,
  RetireRequest,
} from './schemas.js';

/** Enough to refuse a stale controller's delayed request: it retries within moments. */
export const RESUMED_IDS_KEPT = 64;
/** The readiness wait asks again at least this often, in case a change notification was missed. */
export const READINESS_POLL_MS = 1000;
/** After a lease expiry's reopen failed, it is tried again this long after. */
export const LEASE_RETRY_SECONDS = 30;
/** Retires and restored-state deletions run this many at a time. */
export const CONTROL_CONCURRENCY = 64;

export interface StatusReply {
  kind: string;
  instance: string;
  phase: Phase;
  checkpoint_id: string | null;
  lease_expires_at: number | null;
  retired_rollouts: number;
  report: PrepareReport;
  [extra: string]: unknown;
}

export interface PrepareReply {
  phase: Phase;
  report: PrepareReport;
}

export interface CommitReply {
  phase: 'committed';
  manifest: Manifest;
  /** Sorted unique capture keys of the exported records. */
  episode_ids: string[];
  [extra: string]: unknown;
}

export interface RestoreReply {
  phase: 'restored';
  source_checkpoint_id: string;
  /** Sorted capture keys of the next attempt of every installed record. */
  restored: string[];
}

export interface ResumeReply {
  phase: 'idle';
  idempotent: boolean;
}

/** The store functions the plane writes and reads through (injectable for tests). */
export interface ControlStorage {
  write: typeof writeParticipantState;
  read: typeof readParticipantState;
}

export interface ControlPlaneOptions {
  /** How long past a control call's deadline the participant stays closed without hearing from the controller. */
  leaseGraceSeconds: number;
  clock?: ControlClock;
  /** Default LEASE_RETRY_SECONDS. */
  leaseRetrySeconds?: number;
  logger?: Logger;
  storage?: ControlStorage;
  /** `checkpoint.signing_key`: commits sign their manifests, restores refuse unsigned ones. */
  signingKey?: Uint8Array;
  /** `checkpoint.file_mode` / `dir_mode`: the modes a commit writes with (the store's defaults). */
  fileMode?: number;
  dirMode?: number;
}

/** The insertion-ordered memory of resumed checkpoint ids; the oldest is evicted when full. */
class RecentIds {
  readonly #ids = new Set<string>();
  constructor(private readonly capacity: number) {}

  add(id: string): void {
    if (this.#ids.has(id)) return;
    this.#ids.add(id);
    if (this.#ids.size > this.capacity) this.#ids.delete(this.#ids.values().next().value as string);
  }

  has(id: string): boolean {
    return this.#ids.has(id);
  }
}

interface Recorded {
  readonly checkpointId: string;
  /** The arguments it ran with, compared on replay. */
  readonly args: CallArgs;
  readonly reply: object;
}

/** One checkpoint's commit work: created by its first admitted commit, dropped by resume. */
interface CommitWork<R extends CheckpointRecord> {
  readonly checkpointDir: string;
  readonly args: CallArgs;
  readonly exportAbort: AbortController;
  readonly exported: Kept<R[]>;
  readonly writeStop: WriteStop;
  write: Kept<Manifest> | null;
  cleanup: Kept<void> | null;
  parked: Kept<void> | null;
}

/** Directory and scope (as capture keys) of a call, compared on replay. */
interface CallArgs {
  readonly dir: string;
  readonly scope: ReadonlySet<string> | null;
}

const PREPARE_ARGS: CallArgs = { dir: '', scope: null };

function callArgs(checkpointDir: string, scope: readonly EpisodeId[] | null): CallArgs {
  return { dir: checkpointDir, scope: scope === null ? null : new Set(scope.map(captureKey)) };
}

/** Same directory and the same scope in any order (a set: no sort of thousands of keys). */
function sameArgs(a: CallArgs, b: CallArgs): boolean {
  if (a.dir !== b.dir) return false;
  if (a.scope === null || b.scope === null) return a.scope === b.scope;
  if (a.scope.size !== b.scope.size) return false;
  for (const key of a.scope) if (!b.scope.has(key)) return false;
  return true;
}

/** One episode per rollout, at its latest attempt: retiring it stops the earlier ones too. */
function latestPerRollout(episodes: readonly EpisodeId[]): EpisodeId[] {
  const latest = new Map<string, EpisodeId>();
  for (const e of episodes) {
    const current = latest.get(e.rollout_id);
    if (current === undefined || e.attempt > current.attempt) latest.set(e.rollout_id, e);
  }
  return [...latest.values()];
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

function describe(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
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
  readonly #logger: Logger;
  readonly #storage: ControlStorage;
  readonly #signingKey: Uint8Array | undefined;
  readonly #modes: { fileMode?: number; dirMode?: number };
  readonly #lock = new Mutex();
  readonly #resumed = new RecentIds(RESUMED_IDS_KEPT);
  /** Wakes prepares waiting for readiness when the checkpoint changes under them. */
  readonly #waiters = new Set<() => void>();

  #phase: Phase = 'idle';
  #checkpointId: string | null = null;
  #leaseExpiresAt: number | null = null;
  #cancelLeaseTimer: (() => void) | null = null;
  #carriedRestarts = new Set<string>();
  readonly #recorded = new Map<'prepare' | 'commit' | 'restore', Recorded>();
  #work: CommitWork<R> | null = null;
  /** Why the open checkpoint can never commit (a failed export, a regressed readiness). */
  #finalFailure: string | null = null;
  /** The latest restore's install while it runs. */
  #install: Kept<void> | null = null;
  #restoreGeneration = 0;
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
    this.#logger = (
      options.logger ?? createLogger({ server: participant.instance, kind: participant.kind })
    ).child({
      component: 'control-plane',
    });
    this.#storage = options.storage ?? { write: writeParticipantState, read: readParticipantState };
    this.#signingKey = options.signingKey;
    this.#modes = { fileMode: options.fileMode, dirMode: options.dirMode };
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
          lease_expires_at: this.#leaseExpiresAt,
          retired_rollouts: this.participant.marks.size,
          report: this.participant.readiness(),
        } as StatusReply,
        this.participant.statusExtra(),
        'status',
      ),
    );
  }

  renew(req: CheckpointRequest): Promise<{ lease_expires_at: number }> {
    return this.#transition('renew', async () => {
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
    const replayed = await this.#transition('prepare', async () => {
      const earlier = this.#replay('prepare', id, PREPARE_ARGS);
      if (earlier) return earlier as PrepareReply;
      this.#admit('prepare', id);
      // A deadline already passed leaves no time to get ready: refused before admission closes.
      if (this.#clock.now() >= req.deadline_ts) throw new DeadlineExceededError('deadline passed');
      if (this.#phase === 'idle') {
        this.#carriedRestarts = new Set(req.restarts ?? []);
        this.#enter('preparing', id);
        this.#renewLease(req.deadline_ts);
        try {
          await this.participant.closeAdmission({
            checkpointId: id,
            deadlineTs: req.deadline_ts,
            carriedRestarts: this.#carriedRestarts,
          });
        } catch (err) {
          await this.#abandonPrepare('closing admission failed');
          throw err;
        }
      } else {
        // A repeated prepare may carry more restarts; the participant holds the live set.
        for (const key of req.restarts ?? []) this.#carriedRestarts.add(key);
        this.#renewLease(req.deadline_ts);
      }
      return undefined;
    });
    if (replayed) return replayed;

    try {
      await this.#waitReady(id, req.deadline_ts, signal);
    } catch (err) {
      await this.#lock.run(async () => {
        if (this.#phase === 'preparing' && this.#checkpointId === id) {
          await this.#abandonPrepare(`the readiness wait ended: ${describe(err)}`);
        }
      });
      throw this.#typed('prepare', err);
    }

    return this.#transition('prepare', async () => {
      const earlier = this.#replay('prepare', id, PREPARE_ARGS);
      if (earlier) return earlier as PrepareReply;
      // The single listing of blockers, for the reply.
      const report = this.participant.readiness();
      if (this.#phase !== 'preparing' || this.#checkpointId !== id)
        return { phase: this.#phase, report };
      if (!report.ready) {
        if (this.#clock.now() >= req.deadline_ts) {
          this.#logger.warn('prepare deadline passed before the participant was ready', {
            checkpoint_id: id,
            blocker_count: report.blocker_count,
            blockers: report.blockers,
          });
        }
        return { phase: 'preparing', report };
      }
      this.#phase = 'prepared';
      this.#notifyWaiters();
      const reply: PrepareReply = { phase: 'prepared', report };
      this.#recorded.set('prepare', { checkpointId: id, args: PREPARE_ARGS, reply });
      return reply;
    });
  }

  async #waitReady(id: string, deadlineTs: number, signal: AbortSignal | undefined): Promise<void> {
    for (;;) {
      if (signal?.aborted)
        throw signal.reason instanceof Error ? signal.reason : new Error('request aborted');
      if (this.#disposed || this.#phase !== 'preparing' || this.#checkpointId !== id) return;
      if (this.participant.ready()) return;
      const remainingMs = (deadlineTs - this.#clock.now()) * 1000;
      if (remainingMs <= 0) return;
      await new Promise<void>((resolve) => {
        const wake = (): void => {
          unsubscribe();
          cancelTimer();
          this.#waiters.delete(wake);
          signal?.removeEventListener('abort', wake);
          resolve();
        };
        const unsubscribe = this.participant.onChange(wake);
        const cancelTimer = this.#clock.setTimeout(wake, Math.min(READINESS_POLL_MS, remainingMs));
        this.#waiters.add(wake);
        signal?.addEventListener('abort', wake, { once: true });
      });
    }
  }

  /** Ends a prepare that could not finish, without fencing its id (the controller may retry it). */
  async #abandonPrepare(reason: string): Promise<void> {
    this.#logger.warn('prepare abandoned; reopening admission', {
      checkpoint_id: this.#checkpointId,
      reason,
    });
    this.#leave();
    await this.#finishPendingReopen();
  }

  // --- commit -----------------------------------------------------------------------------------

  commit(req: CommitRequest, signal?: AbortSignal): Promise<CommitReply> {
    return this.#transition('commit', async () => {
      const id = req.checkpoint_id;
      const args = callArgs(req.checkpoint_dir, req.episode_ids);
      const earlier = this.#replay('commit', id, args);
      if (earlier) return earlier as CommitReply;
      this.#admit('commit', id);
      this.#renewLease(req.deadline_ts);
      if (this.#finalFailure !== null) throw new ExportFailedError(this.#finalFailure);

      // Before the export starts: a participant's export may do all its work synchronously.
      const startedAt = performance.now();
      const cpuAtStart = process.cpuUsage();
      let work = this.#work;
      if (work === null) {
        work = this.#startCommit(req, args);
      } else if (!sameArgs(work.args, args)) {
        throw new CheckpointConflictError(
          `checkpoint ${id} is already being written to another directory or scope`,
        );
      }
      const bound = <T>(p: Promise<T>): Promise<T> =>
        withinDeadline(p, req.deadline_ts, { clock: this.#clock, signal });

      let records: R[];
      try {
        records = await bound(work.exported.promise);
      } catch (err) {
        if (work.exported.failed)
          throw new ExportFailedError(this.#finalFailure ?? describe(err), { cause: err });
        throw err;
      }

      const current = work;
      if (current.write === null || current.write.failed) {
        // A failed write is retried with the same records: the checkpoint never exports twice.
        current.write = new Kept(() =>
          this.#storage.write({
            checkpointDir: current.checkpointDir,
            kind: this.participant.kind,
            instance: this.participant.instance,
            checkpointId: id,
            records,
            manifestExtra: this.participant.manifestExtra(),
            signingKey: this.#signingKey,
            ...this.#modes,
            stop: current.writeStop,
          }),
        );
      }
      const exportedAt = performance.now();
      const cpuAtExport = process.cpuUsage();
      const manifest = await bound(current.write.promise);
      const writtenAt = performance.now();
      const cpuAtWrite = process.cpuUsage();

      if (current.args.scope !== null) {
        const scopeKeys = current.args.scope;
        if (current.cleanup === null || current.cleanup.failed) {
          current.cleanup = new Kept(() => this.#deleteUnscopedRestored(scopeKeys));
        }
        await bound(current.cleanup.promise);
      }

      if (req.stop) {
        current.parked ??= new Kept(() => this.participant.parkExported(records));
        try {
          await bound(current.parked.promise);
        } catch (err) {
          // The checkpoint is already durable; what stays held is freed by resume or retire.
          this.#logger.warn('park_exported failed; ignored', {
            checkpoint_id: id,
            error: describe(err),
          });
        }
      }

      const reply = withExtra(
        {
          phase: 'committed' as const,
          manifest,
          episode_ids: [...new Set(records.map((r) => captureKey(r.episode_id)))].sort(),
        },
        this.participant.commitReplyExtra(records),
        'commit reply',
      );
      this.#phase = 'committed';
      this.#notifyWaiters();
      this.#recorded.set('commit', { checkpointId: id, args, reply });
      this.#logger.info('checkpoint committed', {
        checkpoint_id: id,
        records: records.length,
        export_ms: elapsedMs(startedAt, exportedAt),
        write_ms: elapsedMs(exportedAt, writtenAt),
        total_ms: elapsedMs(startedAt, performance.now()),
        export_cpu_ms: cpuMs(cpuAtStart, cpuAtExport),
        write_cpu_ms: cpuMs(cpuAtExport, cpuAtWrite),
      });
      return reply;
    });
  }

  /**
   * The first admitted commit of a checkpoint: readiness must still hold (a regression before the
   * export started ends the checkpoint for good), the scope may not name a restart, then the export
   * starts once and is kept.
   */
  #startCommit(req: CommitRequest, args: CallArgs): CommitWork<R> {
    const id = req.checkpoint_id;
    if (!this.participant.ready()) {
      const report = this.participant.readiness();
      this.#finalFailure =
        `participant is no longer ready to commit checkpoint ${id} ` +
        `(blockers=${JSON.stringify(report.blockers)}); resume and prepare again under a new checkpoint id`;
      throw new ExportFailedError(this.#finalFailure);
    }
    const scope = req.episode_ids;
    const scopeKeys = args.scope;
    if (scopeKeys !== null) {
      const restarts = new Set([
        ...this.participant.readiness().restarts,
        ...this.#carriedRestarts,
      ]);
      const named = [...scopeKeys].filter((key) => restarts.has(key)).sort();
      if (named.length > 0) {
        throw new RestartInScopeError(
          `the commit scope names episodes that restart: ${named.join(', ')}`,
        );
      }
    }
    const exportAbort = new AbortController();
    const work: CommitWork<R> = {
      checkpointDir: req.checkpoint_dir,
      args,
      exportAbort,
      exported: new Kept(async () => {
        const records = await this.participant.export(scope, exportAbort.signal);
        const outside =
          scopeKeys === null
            ? []
            : records.map((r) => captureKey(r.episode_id)).filter((k) => !scopeKeys.has(k));
        if (outside.length > 0) {
          throw new CheckpointError(
            `the participant exported episodes outside the commit scope: ${outside.slice(0, 10).join(', ')}`,
          );
        }
        return records;
      }),
      writeStop: new WriteStop(),
      write: null,
      cleanup: null,
      parked: null,
    };
    // Final even when it fails after its commit gave up waiting: a later export could take a later
    // cut than the other participants committed.
    work.exported.promise.catch((err: unknown) => {
      if (this.#work === work && !exportAbort.signal.aborted) {
        this.#finalFailure ??= `the export of checkpoint ${id} failed: ${describe(err)}; resume and prepare again under a new checkpoint id`;
        this.#logger.error('export failed; the checkpoint cannot commit', {
          checkpoint_id: id,
          error: describe(err),
        });
      }
    });
    this.#work = work;
    return work;
  }

  /** Frees restored attempts the commit's scope does not continue; they are not marked retired. */
  async #deleteUnscopedRestored(scopeKeys: ReadonlySet<string>): Promise<void> {
    const unscoped = this.participant
      .restoredPending()
      .filter((e) => !scopeKeys.has(captureKey(e)));
    await forEachBounded(unscoped, CONTROL_CONCURRENCY, (e) => this.participant.deleteRestored(e));
  }

  // --- restore ----------------------------------------------------------------------------------

  restore(req: RestoreRequest, signal?: AbortSignal): Promise<RestoreReply> {
    return this.#transition('restore', async () => {
      const id = req.checkpoint_id;
      const args = callArgs(req.checkpoint_dir, req.episode_ids);
      const earlier = this.#replay('restore', id, args);
      if (earlier) return earlier as RestoreReply;
      this.#admit('restore', id);
      this.participant.checkRestore();
      const bound = <T>(p: Promise<T>): Promise<T> =>
        withinDeadline(p, req.deadline_ts, { clock: this.#clock, signal });

      const scopeKeys = args.scope ?? new Set<string>();
      let generation: number | null = null;
      let install: Kept<void> | null = null;
      let source: Manifest;
      let records: R[];
      const startedAt = performance.now();
      let readAt = startedAt;
      const cpuAtStart = process.cpuUsage();
      let cpuAtRead = cpuAtStart;
      try {
        ({ manifest: source, records } = await bound(
          this.#storage.read<R>({
            checkpointDir: req.checkpoint_dir,
            kind: this.participant.kind,
            instance: this.participant.instance,
            select: (key) => scopeKeys.has(key),
            validate: (record, key) => this.participant.validateRecord(record, key),
            signingKey: this.#signingKey,
          }),
        ));
        readAt = performance.now();
        cpuAtRead = process.cpuUsage();
        // Once the checkpoint is accepted, before the install the deadline limits: a harness that
        // outlived the crash may still call with the attempts this restore replaces. A refused
        // checkpoint raises no marks.
        this.participant.marks.mark(req.episode_ids);
        const earlierInstall = this.#install;
        if (earlierInstall) await bound(earlierInstall.settled());
        // Taking over: an earlier failed restore no longer reopens when its install ends.
        generation = ++this.#restoreGeneration;
        await this.participant.closeAdmission({
          checkpointId: id,
          deadlineTs: req.deadline_ts,
          carriedRestarts: new Set(),
        });
        const toInstall = records;
        install = new Kept(() => this.participant.install(toInstall, req.episode_ids));
        this.#install = install;
        const mine = install;
        void mine.settled().then(() => {
          if (this.#install === mine) this.#install = null;
        });
        await bound(install.promise);
      } catch (err) {
        // A restore cut short (not refused) still refuses the attempts it replaces.
        if (!(err instanceof CheckpointStateError)) this.participant.marks.mark(req.episode_ids);
        if (generation !== null) await this.#rollBackRestore(generation, install);
        throw err;
      }

      this.#enter('restored', id);
      this.#renewLease(req.deadline_ts);
      const reply: RestoreReply = {
        phase: 'restored',
        source_checkpoint_id: source.checkpoint_id,
        restored: records.map((r) => captureKey(nextAttempt(r.episode_id))).sort(),
      };
      this.#recorded.set('restore', { checkpointId: id, args, reply });
      this.#logger.info('checkpoint restored', {
        checkpoint_id: id,
        source_checkpoint_id: source.checkpoint_id,
        records: records.length,
        read_ms: elapsedMs(startedAt, readAt),
        install_ms: elapsedMs(readAt, performance.now()),
        read_cpu_ms: cpuMs(cpuAtStart, cpuAtRead),
        install_cpu_ms: cpuMs(cpuAtRead, process.cpuUsage()),
      });
      return reply;
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
        if (
          this.#phase === 'idle' &&
          this.#restoreGeneration === generation &&
          this.#reopenPending
        ) {
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
      this.#logger.error('reopening admission failed; the next resume retries it', {
        error: describe(err),
      });
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
    return this.#transition('retire', async () => {
      this.#admitOutside('retire', req.checkpoint_id);
      const retiredCount = this.participant.marks.mark(req.episode_ids);
      if (this.#phase === 'restored') this.#renewLease(req.deadline_ts);
      const install = this.#install;
      const stopStarting = new AbortController();
      try {
        await withinDeadline(
          (async () => {
            if (install) await install.settled();
            await forEachBounded(
              latestPerRollout(req.episode_ids),
              CONTROL_CONCURRENCY,
              (e) => this.participant.retire(e),
              stopStarting.signal,
            );
          })(),
          req.deadline_ts,
          { clock: this.#clock, signal },
        );
      } finally {
        stopStarting.abort();
      }
      return { retired_count: retiredCount };
    });
  }

  forget(req: ForgetRequest): Promise<{ forgotten_count: number }> {
    return this.#transition('forget', async () => {
      this.#admitOutside('forget', req.checkpoint_id);
      this.participant.checkForget(req.rollout_ids);
      const forgottenCount = this.participant.marks.forget(req.rollout_ids);
      if (this.#phase === 'restored') this.#renewLease(req.deadline_ts);
      return { forgotten_count: forgottenCount };
    });
  }

  // --- resume and lease expiry ------------------------------------------------------------------

  resume(req: CheckpointRequest, signal?: AbortSignal): Promise<ResumeReply> {
    return this.#transition('resume', async () => {
      const id = req.checkpoint_id;
      const action = resumeAction(
        this.#state(),
        id,
        (x) => this.#resumed.has(x),
        this.#reopenPending,
      );
      if (action instanceof CkptGymError) throw action;
      if (action === 'idempotent') {
        // Remembered even when nothing was open, so a delayed prepare of this id is fenced.
        this.#resumed.add(id);
        return { phase: 'idle', idempotent: true };
      }
      if (action === 'finish-reopen') {
        const install = this.#install;
        if (install)
          await withinDeadline(install.settled(), req.deadline_ts, { clock: this.#clock, signal });
        await this.#reopenAdmission();
        this.#resumed.add(id);
        this.#notifyWaiters();
        return { phase: 'idle', idempotent: false };
      }
      await this.#end(req.deadline_ts, signal);
      return { phase: 'idle', idempotent: false };
    });
  }

  /**
   * Ends the open checkpoint (resume or lease expiry): waits within the deadline for a cleanup
   * still deleting restored state (a replacement may start as that attempt), cancels a running
   * export, stops the writer so no manifest appears after this returns, reopens admission, fences
   * the id. Any failure keeps the phase, so the resume can be retried.
   */
  async #end(deadlineTs: number, signal?: AbortSignal): Promise<void> {
    const work = this.#work;
    if (work) {
      const cleanup = work.cleanup;
      if (cleanup?.running) {
        try {
          await withinDeadline(cleanup.settled(), deadlineTs, { clock: this.#clock, signal });
        } catch (err) {
          if (err instanceof DeadlineExceededError) {
            throw new DeadlineExceededError('restored state is still being deleted; resume again', {
              cause: err,
            });
          }
          throw err;
        }
      }
      work.exportAbort.abort(new Error('the checkpoint was resumed'));
      await work.writeStop.stop();
    }
    await this.#reopenAdmission();
    const id = this.#checkpointId as string;
    this.#resumed.add(id);
    this.#leave();
  }

  #onLeaseTimer(id: string): void {
    this.#cancelLeaseTimer = null;
    void this.#lock.run(async () => {
      if (this.#disposed || this.#checkpointId !== id || this.#leaseExpiresAt === null) return;
      if (this.#clock.now() < this.#leaseExpiresAt) {
        this.#scheduleLease();
        return;
      }
      this.#logger.warn('lease expired; aborting the checkpoint', {
        checkpoint_id: id,
        phase: this.#phase,
      });
      try {
        await this.#end(this.#clock.now() + this.#leaseRetrySeconds);
      } catch (err) {
        this.#logger.error('lease expiry could not reopen; retrying', {
          checkpoint_id: id,
          retry_seconds: this.#leaseRetrySeconds,
          error: describe(err),
        });
        if (!this.#disposed && this.#checkpointId === id) {
          this.#cancelLeaseTimer = this.#clock.setTimeout(
            () => this.#onLeaseTimer(id),
            this.#leaseRetrySeconds * 1000,
          );
        }
      }
    });
  }

  #renewLease(deadlineTs: number): number {
    this.#leaseExpiresAt = extendedLease(this.#leaseExpiresAt, deadlineTs, this.#leaseGraceSeconds);
    this.#scheduleLease();
    return this.#leaseExpiresAt;
  }

  #scheduleLease(): void {
    this.#cancelLeaseTimer?.();
    const id = this.#checkpointId;
    if (this.#disposed || id === null || this.#leaseExpiresAt === null) return;
    this.#cancelLeaseTimer = atTime(this.#clock, this.#leaseExpiresAt, () =>
      this.#onLeaseTimer(id),
    );
  }

  /** Stops the lease timers and any running export; the plane takes no further part. */
  dispose(): void {
    this.#disposed = true;
    this.#cancelLeaseTimer?.();
    this.#cancelLeaseTimer = null;
    this.#work?.exportAbort.abort(new Error('the control plane was disposed'));
    this.#notifyWaiters();
  }

  // --- shared steps -----------------------------------------------------------------------------

  #state(): { phase: Phase; checkpointId: string | null } {
    return { phase: this.#phase, checkpointId: this.#checkpointId };
  }

  #admit(op: FencedOperation, checkpointId: string): void {
    const refusal = admissionError(op, this.#state(), checkpointId, (id) => this.#resumed.has(id));
    if (refusal) throw refusal;
  }

  #admitOutside(op: 'retire' | 'forget', checkpointId: string): void {
    const refusal = outsideCheckpointError(op, this.#state(), checkpointId);
    if (refusal) throw refusal;
  }

  /** A completed operation's reply for the same arguments; another directory or scope conflicts. */
  #replay(
    op: 'prepare' | 'commit' | 'restore',
    checkpointId: string,
    args: CallArgs,
  ): object | undefined {
    const recorded = this.#recorded.get(op);
    if (recorded === undefined || recorded.checkpointId !== checkpointId) return undefined;
    if (!sameArgs(recorded.args, args)) {
      throw new CheckpointConflictError(
        `checkpoint ${checkpointId} already completed ${op} with another directory or scope`,
      );
    }
    return recorded.reply;
  }

  #enter(phase: Phase, checkpointId: string): void {
    this.#phase = phase;
    this.#checkpointId = checkpointId;
    // Admission is closed by this checkpoint now; its resume or expiry reopens it.
    this.#reopenPending = false;
    this.#notifyWaiters();
  }

  /** Back to idle: drops the checkpoint's lease, results, work and carried restarts. */
  #leave(): void {
    this.#phase = 'idle';
    this.#checkpointId = null;
    this.#leaseExpiresAt = null;
    this.#cancelLeaseTimer?.();
    this.#cancelLeaseTimer = null;
    this.#recorded.clear();
    this.#work = null;
    this.#finalFailure = null;
    this.#carriedRestarts = new Set();
    this.#notifyWaiters();
  }

  #notifyWaiters(): void {
    for (const wake of [...this.#waiters]) wake();
  }

  /** Runs a transition under the lock; anything untyped a hook throws becomes `checkpoint_error`. */
  async #transition<T>(op: string, fn: () => Promise<T>): Promise<T> {
    try {
      return await this.#lock.run(fn);
    } catch (err) {
      throw this.#typed(op, err);
    }
  }

  #guard<T>(op: string, fn: () => T): T {
    try {
      return fn();
    } catch (err) {
      throw this.#typed(op, err);
    }
  }

  #typed(op: string, err: unknown): CkptGymError {
    if (err instanceof CkptGymError) return err;
    this.#logger.error(`checkpoint ${op} failed`, {
      error: err instanceof Error ? (err.stack ?? err.message) : String(err),
    });
    return new CheckpointError(`checkpoint ${op} failed: ${describe(err)}`, { cause: err });
  }
}
