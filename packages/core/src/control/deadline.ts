/**
 * Time for the control plane: wall-clock epoch seconds (as `deadline_ts` travels on the wire),
 * timers, deadline-bounded waits, kept work, a transition lock and bounded fan-out. The clock is
 * injectable so tests can drive deadlines and leases without sleeping.
 */
import { DeadlineExceededError } from '../errors.js';

export interface ControlClock {
  /** Wall-clock seconds since the Unix epoch. */
  now(): number;
  /** Calls `fn` after about `ms` milliseconds (possibly early: callers re-check); returns a cancel. */
  setTimeout(fn: () => void, ms: number): () => void;
}

/**
 * How far ahead of now a control call's `deadline_ts` may be (24 h). The lease a call sets ends a
 * grace after its deadline, so this also bounds how long a forgotten checkpoint keeps admission
 * closed (a `deadline_ts` of 1e308 once gave a lease that never expired).
 */
export const MAX_DEADLINE_AHEAD_SECONDS = 24 * 60 * 60;

/** Node timers clamp longer delays to 1 ms; a longer wait fires early and callers re-arm. */
const MAX_TIMER_MS = 2 ** 31 - 1;

export const systemClock: ControlClock = {
  now: () => Date.now() / 1000,
  setTimeout(fn, ms) {
    const timer = setTimeout(fn, Math.min(Math.max(ms, 0), MAX_TIMER_MS));
    // A pending lease or deadline must not keep a finished process alive.
    timer.unref();
    return () => clearTimeout(timer);
  },
};

/** Runs `fn` once `clock` reaches `ts` (re-arming after an early timer); returns a cancel. */
export function atTime(clock: ControlClock, ts: number, fn: () => void): () => void {
  let cancel: () => void = () => undefined;
  const arm = (): void => {
    const remaining = ts - clock.now();
    if (remaining <= 0) {
      fn();
      return;
    }
    cancel = clock.setTimeout(arm, remaining * 1000);
  };
  arm();
  return () => cancel();
}

function abortReason(signal: AbortSignal): Error {
  return signal.reason instanceof Error ? signal.reason : new Error('request aborted');
}

/**
 * Awaits `work` until `deadlineTs`: `deadline_exceeded` ("deadline passed") when it has already
 * passed, ("deadline passed during I/O") when it passes while waiting. The work itself is not
 * stopped; whoever keeps it may await it again. `signal` (a client that went away) also ends the wait.
 */
export function withinDeadline<T>(
  work: Promise<T>,
  deadlineTs: number,
  options: { clock?: ControlClock; signal?: AbortSignal | undefined } = {},
): Promise<T> {
  const clock = options.clock ?? systemClock;
  const signal = options.signal;
  // The caller keeps `work`; a rejection after we stopped waiting is theirs, never unhandled.
  work.catch(() => undefined);
  if (clock.now() >= deadlineTs)
    return Promise.reject(new DeadlineExceededError('deadline passed'));
  if (signal?.aborted) return Promise.reject(abortReason(signal));
  return new Promise<T>((resolve, reject) => {
    let done = false;
    const finish = (settle: () => void): void => {
      if (done) return;
      done = true;
      cancelTimer();
      signal?.removeEventListener('abort', onAbort);
      settle();
    };
    const onAbort = (): void => finish(() => reject(abortReason(signal as AbortSignal)));
    const cancelTimer = atTime(clock, deadlineTs, () =>
      finish(() => reject(new DeadlineExceededError('deadline passed during I/O'))),
    );
    signal?.addEventListener('abort', onAbort, { once: true });
    work.then(
      (value) => finish(() => resolve(value)),
      (err: unknown) => finish(() => reject(err)),
    );
  });
}

/**
 * Work that outlives the request that started it (an export, a write, a cleanup, an install):
 * retries and resume await the same promise instead of starting it again.
 */
export class Kept<T> {
  readonly promise: Promise<T>;
  #state: 'running' | 'done' | 'failed' = 'running';
  #error: unknown;

  constructor(start: () => Promise<T>) {
    // An async wrapper turns a synchronous throw of `start` into a rejection like any other.
    this.promise = (async () => start())();
    this.promise.then(
      () => {
        this.#state = 'done';
      },
      (err: unknown) => {
        this.#state = 'failed';
        this.#error = err;
      },
    );
  }

  get running(): boolean {
    return this.#state === 'running';
  }

  get failed(): boolean {
    return this.#state === 'failed';
  }

  get error(): unknown {
    return this.#error;
  }

  /** Resolves once the work ended, whatever its outcome. */
  settled(): Promise<void> {
    return this.promise.then(
      () => undefined,
      () => undefined,
    );
  }
}

/** Retires and restored-state deletions run this many at a time. */
export const CONTROL_CONCURRENCY = 64;

/**
 * Runs `fn` over `items` with at most `limit` at a time. Stops starting new items once `signal`
 * aborts (a passed deadline); items already started run to their end. Rejects with the first
 * failure once every started item has ended.
 */
export async function forEachBounded<T>(
  items: readonly T[],
  limit: number,
  fn: (item: T) => Promise<void>,
  signal?: AbortSignal,
): Promise<void> {
  let next = 0;
  let failure: { error: unknown } | undefined;
  const worker = async (): Promise<void> => {
    while (next < items.length && !signal?.aborted) {
      const item = items[next++] as T;
      try {
        await fn(item);
      } catch (error) {
        failure ??= { error };
      }
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  if (failure) throw failure.error;
}
