/**
 * Episode steps: where each live episode can continue. An episode is a sequence of steps; after
 * each completed step its owner records a boundary (a JSON object naming the next step and what it
 * needs), and a checkpoint is always taken at boundaries. Shared by the environment and agent
 * participants.
 *
 * A step in flight when a checkpoint closes runs in `wait` mode (the checkpoint waits for it, then
 * the episode parks at its next boundary) or `replay` mode (the checkpoint does not wait: the
 * boundary before the step is exported and the step runs again after a crash).
 */
import { AdmissionGate, type AdmissionTicket } from './admission/gate.js';
import { CheckpointError, DeadlineExceededError, StaleAttemptError } from './errors.js';
import { IdleQueue } from './idle-queue.js';
import { encodeJson, type JsonObject } from './json.js';
import { MAX_REPORTED_BLOCKERS } from './participant.js';

export type StepMode = 'wait' | 'replay';
export type EpisodeState = 'running' | 'wait_step' | 'replay_step' | 'parked';
export type Boundary = JsonObject;
/**
 * A boundary, or a builder called only when the boundary is exported. A builder exported while its
 * episode is inside a replay step runs concurrently with that step, so it must not read state the
 * step changes.
 */
export type BoundaryInput = Boundary | (() => Boundary);

export interface EpisodeFlags {
  readonly state: EpisodeState;
  readonly retired: boolean;
  readonly restart: boolean;
}

export interface EpisodeView extends EpisodeFlags {
  readonly finishing: boolean;
}

/**
 * The blocking rule: an episode holds up a checkpoint while it is being retired, or while it is
 * between boundaries or inside a wait step, unless it is a restart (which is never captured).
 */
export function isBlocking(episode: EpisodeFlags): boolean {
  return (
    episode.retired ||
    (!episode.restart && (episode.state === 'running' || episode.state === 'wait_step'))
  );
}

/**
 * A recorded boundary: a builder is built once, when first needed (it pins what it reads), and the
 * boundary encoded once; recording a new one drops both. What an episode, and an agent session,
 * exports.
 */
export class RecordedBoundary {
  #input: BoundaryInput | null;
  #json: string | undefined;

  constructor(input: BoundaryInput | null = null) {
    this.#input = input;
  }

  get recorded(): boolean {
    return this.#input !== null;
  }

  set(input: BoundaryInput | null): void {
    this.#input = input;
    this.#json = undefined;
  }

  value(): Boundary | null {
    if (typeof this.#input === 'function') this.#input = this.#input();
    return this.#input;
  }

  json(): string {
    this.#json ??= encodeJson(this.value());
    return this.#json;
  }
}

/** What a checkpoint exports: episodes parked or inside a replay step, not retired, not restarts. */
function isExportable(episode: EpisodeFlags): boolean {
  return (
    (episode.state === 'parked' || episode.state === 'replay_step') &&
    !episode.retired &&
    !episode.restart
  );
}

/** The `limit` smallest keys in code-unit order, without sorting all of them. */
export function smallestKeys(keys: Iterable<string>, limit: number): string[] {
  const out: string[] = [];
  if (limit <= 0) return out;
  for (const key of keys) {
    if (out.length >= limit && key >= out[out.length - 1]!) continue;
    let lo = 0;
    let hi = out.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (out[mid]! < key) lo = mid + 1;
      else hi = mid;
    }
    out.splice(lo, 0, key);
    if (out.length > limit) out.pop();
  }
  return out;
}

/** What an episode's work is given to record its progress. */
export interface EpisodeContext {
  readonly key: string;
  /** Aborted by the first retire (unless finishing) or when the episode's deadline passes. */
  readonly signal: AbortSignal;
  /** The restored boundary this episode continues from, handed out once; null afterwards. */
  continuation(): Boundary | null;
  /** Records a boundary; while a checkpoint is open, parks here until resume. */
  boundary(state: BoundaryInput): Promise<void>;
  /** Runs one step in `mode`. */
  step<T>(mode: StepMode, fn: () => Promise<T>): Promise<T>;
  /** Marks the episode a restart once no checkpoint is open, so a checkpoint's restarts stay fixed. */
  markRestart(): Promise<void>;
  /** The final cleanup has started: from now on a retire waits for it and never aborts it. */
  finishing(): void;
}

export interface RunOptions {
  /** The restored boundary: handed out once by `continuation()` and exported until a new one. */
  continuation?: Boundary | null;
  /** Seconds of work allowed; time parked for a checkpoint does not count. None when omitted. */
  deadlineSeconds?: number | null;
  /** Start as a restart: never blocks (unless retired), never parks, never exported. */
  restart?: boolean;
}

export interface EpisodeStepsOptions {
  /** Readiness may have changed; called only while a checkpoint is open. */
  onChange?: () => void;
  /** An episode is no longer tracked (so an owner's index of the keys can drop it). */
  onForget?: (key: string) => void;
  /**
   * How long an exportable episode waits, with admission open, before its boundary is encoded
   * ahead (0, the default: the next idle turn). Closing admission encodes the waiting ones at once.
   */
  encodeAheadSettleMs?: number;
}

/** A timer whose remaining time can be frozen and thawed. */
class SuspendableDeadline {
  private timer: NodeJS.Timeout | undefined;
  private expiresAt = 0;
  private remainingMs: number | null = null;
  private over = false;

  constructor(
    ms: number,
    private readonly onExpire: () => void,
  ) {
    this.arm(ms);
  }

  private arm(ms: number): void {
    this.expiresAt = performance.now() + ms;
    this.timer = setTimeout(() => {
      this.over = true;
      this.onExpire();
    }, ms);
  }

  suspend(): void {
    if (this.over || this.remainingMs !== null) return;
    clearTimeout(this.timer);
    this.remainingMs = Math.max(0, this.expiresAt - performance.now());
  }

  resume(): void {
    if (this.over || this.remainingMs === null) return;
    const ms = this.remainingMs;
    this.remainingMs = null;
    this.arm(ms);
  }

  cancel(): void {
    this.over = true;
    clearTimeout(this.timer);
  }
}

class Episode implements EpisodeView {
  state: EpisodeState = 'running';
  retired = false;
  finishing = false;
  /** False once forgotten: a late call from a finished episode then changes nothing. */
  tracked = true;
  readonly boundary: RecordedBoundary;
  continuation: Boundary | null;
  deadline: SuspendableDeadline | undefined;
  /** Settles (never rejects) once the work has ended and the episode is forgotten. */
  ended: Promise<void> = Promise.resolve();
  private wakeup: Promise<void> | undefined;
  private resolveWakeup: (() => void) | undefined;

  constructor(
    readonly key: string,
    /** The episode's admission; its signal is the work's (a retire or the deadline aborts it). */
    readonly ticket: AdmissionTicket,
    public restart: boolean,
    continuation: Boundary | null,
  ) {
    this.boundary = new RecordedBoundary(continuation);
    this.continuation = continuation;
  }

  /**
   * Resolves at the next wake(); waiters re-check their condition, so no wake-up is lost. Each
   * episode parks on its own wake-up (not the gate's): a retire then wakes only its episode.
   */
  nextWake(): Promise<void> {
    this.wakeup ??= new Promise<void>((resolve) => {
      this.resolveWakeup = resolve;
    });
    return this.wakeup;
  }

  wake(): void {
    const resolve = this.resolveWakeup;
    this.wakeup = undefined;
    this.resolveWakeup = undefined;
    resolve?.();
  }
}

/** Waits for `done`, or rejects with the signal's reason when the caller stops waiting. */
function untilDone(done: Promise<void>, signal: AbortSignal | undefined): Promise<void> {
  if (!signal) return done;
  if (signal.aborted) return Promise.reject(signal.reason);
  return new Promise<void>((resolve, reject) => {
    const onAbort = () => reject(signal.reason);
    signal.addEventListener('abort', onAbort, { once: true });
    void done.then(() => {
      signal.removeEventListener('abort', onAbort);
      resolve();
    });
  });
}

export class EpisodeSteps {
  /** Open or closed for a checkpoint; each tracked episode holds a ticket, under its key. */
  readonly gate = new AdmissionGate();
  private readonly episodes = new Map<string, Episode>();
  private readonly onChange: (() => void) | undefined;
  private readonly onForget: ((key: string) => void) | undefined;
  /** Maintained on every state or flag change, never recounted, so `ready()` costs nothing. */
  private blocking = 0;
  /** Episodes whose exported boundary is encoded ahead of a commit. */
  private readonly toEncode: IdleQueue<Episode>;

  constructor(options: EpisodeStepsOptions = {}) {
    this.onChange = options.onChange;
    this.onForget = options.onForget;
    this.toEncode = new IdleQueue<Episode>(
      (ep) => {
        if (ep.tracked && isExportable(ep)) ep.boundary.json();
      },
      { settleMs: options.encodeAheadSettleMs ?? 0, urgent: () => this.closed },
    );
  }

  /**
   * Tracks the episode `key` while `work` runs and forgets it when the work settles. A key already
   * tracked is refused (`checkpoint_error`) and the refused call touches nothing of the live one.
   */
  run<T>(
    key: string,
    options: RunOptions,
    work: (episode: EpisodeContext) => Promise<T>,
  ): Promise<T> {
    if (this.episodes.has(key)) {
      return Promise.reject(new CheckpointError(`episode ${key} is already running`));
    }
    const ticket = this.gate.enter({ key, tag: 'episode' });
    const ep = new Episode(key, ticket, options.restart ?? false, options.continuation ?? null);
    this.episodes.set(key, ep);
    if (isBlocking(ep)) this.blocking += 1;
    if (options.deadlineSeconds != null) {
      const seconds = options.deadlineSeconds;
      ep.deadline = new SuspendableDeadline(seconds * 1000, () => {
        this.gate.abort(
          ticket,
          new DeadlineExceededError(`episode ${key} passed its deadline of ${seconds} s`),
        );
        // Only this class aborts its tickets, and each abort wakes the episode (no listener each).
        ep.wake();
      });
    }
    this.changed();

    const context: EpisodeContext = {
      key,
      signal: ticket.signal,
      continuation: () => {
        const continuation = ep.continuation;
        ep.continuation = null;
        return continuation;
      },
      boundary: (state) => this.boundary(ep, state),
      step: (mode, fn) => this.step(ep, mode, fn),
      markRestart: () => this.markRestart(ep),
      finishing: () => {
        ep.finishing = true;
      },
    };
    let working: Promise<T>;
    try {
      working = work(context);
    } catch (err) {
      working = Promise.reject(err);
    }
    const result = working.finally(() => this.end(ep));
    ep.ended = result.then(
      () => undefined,
      () => undefined,
    );
    return result;
  }

  get closed(): boolean {
    return !this.gate.isOpen;
  }

  /** A checkpoint closes admission: episodes park at their next boundary. */
  close(): void {
    this.gate.close();
    for (const ep of this.episodes.values()) {
      if (ep.state === 'parked' || ep.state === 'replay_step') ep.deadline?.suspend();
    }
    this.toEncode.hurry();
  }

  /** Resume: releases parked episodes and restarts their deadlines. */
  open(): void {
    this.gate.open();
    for (const ep of this.episodes.values()) {
      ep.deadline?.resume();
      ep.wake();
    }
  }

  /**
   * Stops the episode and waits until its work has ended. It blocks from here on and stays tracked
   * until then, so a retire cut short by `signal` leaves it for a retry, which waits again. Only
   * an episode not yet finishing is aborted: a retire never interrupts final cleanup. An abort
   * happens at most once (a signal aborts once), so a retry never interrupts the cleanup the first
   * retire started.
   */
  async retire(key: string, signal?: AbortSignal): Promise<void> {
    const ep = this.episodes.get(key);
    if (!ep) return;
    this.update(ep, () => {
      ep.retired = true;
    });
    if (!ep.finishing)
      this.gate.abort(ep.ticket, new StaleAttemptError(`episode ${key} was retired`));
    ep.wake();
    await untilDone(ep.ended, signal);
  }

  blockerCount(): number {
    return this.blocking;
  }

  /** The `limit` smallest blocking keys; no scan at all when nothing blocks. */
  blockers(limit: number = MAX_REPORTED_BLOCKERS): string[] {
    if (this.blocking === 0) return [];
    const keys: string[] = [];
    for (const ep of this.episodes.values()) if (isBlocking(ep)) keys.push(ep.key);
    return smallestKeys(keys, limit);
  }

  /**
   * Boundaries of the episodes a checkpoint continues: parked or inside a replay step, not retired,
   * not restarts. Null means no boundary yet: the episode starts over from its input.
   */
  exported(): Map<string, Boundary | null> {
    const out = new Map<string, Boundary | null>();
    for (const ep of this.episodes.values()) {
      if (isExportable(ep)) out.set(ep.key, ep.boundary.value());
    }
    return out;
  }

  /**
   * The JSON text of the boundary `exported()` gives for `key` (undefined when `key` is not tracked).
   * Usually encoded already: an episode's boundary is encoded in idle turns once the episode
   * parks or enters a replay step, the states a checkpoint exports it in, so a commit of thousands
   * of episodes writes text instead of encoding (and allocating) while every rollout waits.
   */
  boundaryJson(key: string): string | undefined {
    return this.episodes.get(key)?.boundary.json();
  }

  /** Sorted keys of restarts not being retired. */
  restarts(): string[] {
    const out: string[] = [];
    for (const ep of this.episodes.values()) if (ep.restart && !ep.retired) out.push(ep.key);
    return out.sort();
  }

  /** A read-only view of a tracked episode's state and flags. */
  state(key: string): EpisodeView | undefined {
    const ep = this.episodes.get(key);
    return (
      ep && { state: ep.state, retired: ep.retired, restart: ep.restart, finishing: ep.finishing }
    );
  }

  keys(): IterableIterator<string> {
    return this.episodes.keys();
  }

  has(key: string): boolean {
    return this.episodes.has(key);
  }

  get size(): number {
    return this.episodes.size;
  }

  private changed(): void {
    // Outside a checkpoint nobody waits on readiness, so a step costs nothing extra.
    if (this.closed) this.onChange?.();
  }

  /** Applies a state or flag change, keeping the blocker count exact. */
  private update(ep: Episode, mutate: () => void): void {
    const before = ep.tracked && isBlocking(ep);
    mutate();
    const after = ep.tracked && isBlocking(ep);
    if (before !== after) this.blocking += after ? 1 : -1;
    if (ep.tracked && isExportable(ep)) this.toEncode.add(ep);
    else this.toEncode.delete(ep);
    this.changed();
  }

  private end(ep: Episode): void {
    if (!ep.tracked) return;
    if (isBlocking(ep)) this.blocking -= 1;
    ep.tracked = false;
    this.episodes.delete(ep.key);
    this.gate.leave(ep.ticket);
    this.onForget?.(ep.key);
    this.toEncode.delete(ep);
    ep.deadline?.cancel();
    this.changed();
  }

  private async boundary(ep: Episode, state: BoundaryInput): Promise<void> {
    ep.boundary.set(state);
    if (!ep.tracked) return;
    if (!this.closed || ep.restart) {
      if (ep.state !== 'running') {
        this.update(ep, () => {
          ep.state = 'running';
        });
      }
      return;
    }
    await this.park(ep);
  }

  /**
   * Holds the episode at its boundary until admission reopens. A wake-up that finds a newer
   * checkpoint closed keeps waiting; a retired episode is stopped with `stale_attempt`.
   */
  private async park(ep: Episode, cause?: unknown): Promise<void> {
    this.update(ep, () => {
      ep.state = 'parked';
    });
    ep.deadline?.suspend();
    try {
      while (true) {
        if (ep.retired) {
          throw new StaleAttemptError(
            `episode ${ep.key} was retired while parked`,
            cause === undefined ? undefined : { cause },
          );
        }
        if (!this.closed) return;
        await ep.nextWake();
      }
    } finally {
      this.update(ep, () => {
        ep.state = 'running';
      });
    }
  }

  private async step<T>(ep: Episode, mode: StepMode, fn: () => Promise<T>): Promise<T> {
    if (ep.tracked) {
      this.update(ep, () => {
        ep.state = mode === 'wait' ? 'wait_step' : 'replay_step';
      });
      if (mode === 'replay' && this.closed) ep.deadline?.suspend();
    }
    let result: T;
    try {
      result = await fn();
    } catch (err) {
      if (ep.tracked && mode === 'replay' && this.closed) {
        // Its failure cleanup may close sessions the earlier boundary needs: export it with no
        // boundary (start over) and hold the failure until resume, so it neither blocks this
        // checkpoint nor finishes and drops its record before the commit.
        ep.boundary.set(null);
        await this.park(ep, err);
      } else {
        this.leaveStep(ep);
      }
      throw err;
    }
    // A replay step that completes during a checkpoint stays at the boundary before it until its
    // next boundary parks it with the step's result.
    if (!(mode === 'replay' && this.closed)) this.leaveStep(ep);
    return result;
  }

  /** Back between boundaries; a deadline suspended during the step was resumed by open(). */
  private leaveStep(ep: Episode): void {
    if (!ep.tracked) return;
    this.update(ep, () => {
      ep.state = 'running';
    });
  }

  private async markRestart(ep: Episode): Promise<void> {
    while (this.closed) {
      if (ep.ticket.signal.aborted) throw ep.ticket.signal.reason;
      await ep.nextWake();
    }
    this.update(ep, () => {
      ep.restart = true;
    });
  }
}
