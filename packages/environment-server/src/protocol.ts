/**
 * The episode protocol every environment server speaks: `POST /run` with
 * `{episode_id, task: {task_id: {taskset, task_id}, task_input}}` answers
 * `{episode_id, task_id, result | failure}`. This module holds its pure parts (reply shapes, failure
 * classification; the request's shape is core's `parseEpisodeRequest`), queue admission and the
 * LIFO cleanup stack.
 */
import {
  type EpisodeId,
  type EpisodeRequest,
  episodeIdToJson,
  type JsonObject,
  type JsonValue,
  type Task,
  type TaskId,
} from '@ckpt-gym/core/protocol';
import {
  type Boundary,
  type BoundaryInput,
  type Logger,
  type StepMode,
} from '@ckpt-gym/core/server';

export const MAX_FAILURE_REASON_CHARS = 2000;

/** Where an episode failed; `admission` is the queue, the others name protocol stages. */
export type FailureStage = 'admission' | 'seed' | 'agent' | 'verification' | 'cleanup';

export interface EpisodeFailure {
  failure_reason: string;
  /** True: collection must not retry the episode. */
  terminal: boolean;
  failure_kind?: string;
  stage?: FailureStage;
  [extra: string]: JsonValue | undefined;
}

export interface EpisodeReply {
  episode_id: { rollout_id: string; attempt: number };
  task_id: TaskId;
  result: JsonObject | null;
  failure: EpisodeFailure | null;
}

/** The task as JSON, what the task digest covers. */
export function taskJson(task: Task): JsonObject {
  return {
    task_id: { taskset: task.task_id.taskset, task_id: task.task_id.task_id },
    task_input: task.task_input,
  };
}

export function truncateReason(reason: string): string {
  return reason.length <= MAX_FAILURE_REASON_CHARS
    ? reason
    : reason.slice(0, MAX_FAILURE_REASON_CHARS);
}

export function resultReply(request: EpisodeRequest, result: JsonObject): EpisodeReply {
  return {
    episode_id: episodeIdToJson(request.episode_id),
    task_id: request.task.task_id,
    result,
    failure: null,
  };
}

export function failureReply(request: EpisodeRequest, failure: EpisodeFailure): EpisodeReply {
  const clean: EpisodeFailure = {
    ...failure,
    failure_reason: truncateReason(failure.failure_reason),
  };
  // Optional fields are left out when unset, as on the wire.
  for (const key of Object.keys(clean)) if (clean[key] === undefined) delete clean[key];
  return {
    episode_id: episodeIdToJson(request.episode_id),
    task_id: request.task.task_id,
    result: null,
    failure: clean,
  };
}

/** Thrown by a protocol to fail the episode with this exact failure. */
export class HandledEpisodeError extends Error {
  constructor(
    readonly failure: EpisodeFailure,
    options?: { cause?: unknown },
  ) {
    super(failure.failure_reason, options);
    this.name = 'HandledEpisodeError';
  }
}

export const RETRYABLE_STATUSES: ReadonlySet<number> = new Set([408, 425, 429]);

/** Error codes of a connection that failed, was cut or timed out (node and got). */
const RETRYABLE_CODES: ReadonlySet<string> = new Set([
  'ECONNREFUSED',
  'ECONNRESET',
  'EPIPE',
  'ETIMEDOUT',
  'EHOSTUNREACH',
  'ENETUNREACH',
  'EAI_AGAIN',
  'ENOTFOUND',
  'ECONNABORTED',
  'ERR_STREAM_PREMATURE_CLOSE',
  'ERR_GOT_REQUEST_ERROR',
]);

/** An HTTP status a retry may cure: 408, 425, 429, any 5xx. */
export function isRetryableStatus(status: number): boolean {
  return RETRYABLE_STATUSES.has(status) || status >= 500;
}

/**
 * True when retrying the episode may succeed: a retryable HTTP status, a connection error, a body
 * cut off mid-stream, or a timeout. Everything else (a 4xx, a malformed reply) is terminal.
 */
export function isRetryableError(err: unknown): boolean {
  if (!(err instanceof Error)) return false;
  const e = err as Error & { response?: { statusCode?: unknown }; code?: unknown };
  const status = e.response?.statusCode;
  if (typeof status === 'number') return isRetryableStatus(status);
  if (e.name === 'TimeoutError' || e.name === 'ReadError') return true;
  if (typeof e.code === 'string' && RETRYABLE_CODES.has(e.code)) return true;
  return e.cause !== undefined && e.cause !== err && isRetryableError(e.cause);
}

/** The failure of a downstream call at `stage`: retryable errors are not terminal. */
export function stageFailure(
  stage: FailureStage,
  what: string,
  err: unknown,
  extra: Record<string, JsonValue> = {},
): HandledEpisodeError {
  const message = err instanceof Error ? `${err.name}: ${err.message}` : String(err);
  return new HandledEpisodeError(
    {
      failure_reason: truncateReason(`${what} failed: ${message}`),
      terminal: !isRetryableError(err),
      stage,
      ...extra,
    },
    { cause: err },
  );
}

export function unhandledFailure(err: unknown): EpisodeFailure {
  const message = err instanceof Error ? `${err.name}: ${err.message}` : String(err);
  return {
    failure_reason: truncateReason(`Unhandled environment server error: ${message}`),
    terminal: true,
  };
}

export const TIMED_OUT_FAILURE: EpisodeFailure = {
  failure_reason: 'Episode timed out',
  terminal: false,
};

export const ADMISSION_TIMED_OUT_FAILURE: EpisodeFailure = {
  failure_reason: 'Episode admission timed out',
  terminal: false,
  stage: 'admission',
};

// --- queue admission --------------------------------------------------------------------------

/**
 * Bounds how many episodes run at once (separate from checkpoint admission). Waiters are served
 * first come, first served; a waiter that times out leaves the queue.
 */
export class EpisodeQueue {
  private running = 0;
  private readonly waiters: (() => void)[] = [];

  constructor(readonly limit: number) {
    if (!Number.isSafeInteger(limit) || limit < 1) {
      throw new RangeError(`max_concurrent_episodes must be an integer ≥ 1, got ${limit}`);
    }
  }

  get active(): number {
    return this.running;
  }

  get waiting(): number {
    return this.waiters.length;
  }

  /** Resolves with a release function, or null when no slot freed within `timeoutSeconds`. */
  acquire(timeoutSeconds: number, signal?: AbortSignal): Promise<(() => void) | null> {
    if (this.running < this.limit) {
      this.running += 1;
      return Promise.resolve(this.releaser());
    }
    return new Promise((resolve) => {
      const admit = () => {
        clearTimeout(timer);
        signal?.removeEventListener('abort', giveUp);
        this.running += 1;
        resolve(this.releaser());
      };
      const giveUp = () => {
        clearTimeout(timer);
        const index = this.waiters.indexOf(admit);
        if (index >= 0) this.waiters.splice(index, 1);
        resolve(null);
      };
      const timer = setTimeout(giveUp, timeoutSeconds * 1000);
      signal?.addEventListener('abort', giveUp, { once: true });
      this.waiters.push(admit);
    });
  }

  private releaser(): () => void {
    let released = false;
    return () => {
      if (released) return;
      released = true;
      this.running -= 1;
      this.waiters.shift()?.();
    };
  }
}

// --- cleanup ----------------------------------------------------------------------------------

export type CleanupFn = (signal: AbortSignal) => Promise<void>;

/** One registered cleanup: idempotent, done only once it succeeded. */
export class CleanupHandle {
  private done = false;
  private running: Promise<void> | undefined;

  constructor(
    readonly name: string,
    private readonly fn: CleanupFn,
    private readonly timeoutSeconds: number,
  ) {}

  get active(): boolean {
    return !this.done;
  }

  /**
   * Runs the cleanup now (bounded by the cleanup timeout, or `signal`), unless it already
   * succeeded; concurrent calls share one run.
   */
  close(signal?: AbortSignal): Promise<void> {
    if (this.done) return Promise.resolve();
    this.running ??= (async () => {
      const timeout = AbortSignal.timeout(this.timeoutSeconds * 1000);
      try {
        await this.fn(signal ? AbortSignal.any([signal, timeout]) : timeout);
        this.done = true;
      } finally {
        this.running = undefined;
      }
    })();
    return this.running;
  }
}

/**
 * The episode's cleanup callbacks, unwound last-in first-out before `/run` replies. The unwind
 * runs outside the episode's signal (a retire never interrupts it), within one total timeout, and
 * logs failures instead of raising them.
 */
export class CleanupStack {
  private readonly entries: CleanupHandle[] = [];

  constructor(
    private readonly timeoutSeconds: number,
    private readonly logger?: Pick<Logger, 'warn'>,
  ) {}

  push(name: string, fn: CleanupFn): CleanupHandle {
    const handle = new CleanupHandle(name, fn, this.timeoutSeconds);
    this.entries.push(handle);
    return handle;
  }

  get size(): number {
    return this.entries.length;
  }

  async unwind(): Promise<void> {
    const total = AbortSignal.timeout(this.timeoutSeconds * 1000);
    while (this.entries.length > 0) {
      const handle = this.entries.pop()!;
      if (!handle.active) continue;
      try {
        await handle.close(total);
      } catch (err) {
        this.logger?.warn('episode cleanup failed', {
          cleanup: handle.name,
          error: err instanceof Error ? err.message : String(err),
        });
      }
    }
  }
}

// --- what a protocol implements -----------------------------------------------------------------

/** What an episode's protocol is given: its identity, signal, cleanup stack and steps. */
export interface EpisodeWork {
  readonly episode: EpisodeId;
  /** The capture key every downstream call is made under. */
  readonly key: string;
  /** Aborted by a retire (before final cleanup), the episode deadline or a client disconnect. */
  readonly signal: AbortSignal;
  readonly checkpointing: boolean;
  readonly cleanup: CleanupStack;
  /** The restored boundary this attempt continues from (once); null for a fresh episode. */
  continuation(): Boundary | null;
  /**
   * Records a boundary; parks here while a checkpoint is open. A builder is called only when a
   * checkpoint exports it, so nothing is built with checkpointing off.
   */
  boundary(state: BoundaryInput): Promise<void>;
  step<T>(mode: StepMode, fn: () => Promise<T>): Promise<T>;
  /** A server this episode depends on cannot capture its part: never blocks, never exported. */
  markRestart(): Promise<void>;
}

export interface EnvironmentProtocol {
  /** False: the protocol records no boundaries and every episode is a restart. */
  readonly checkpointBoundaries: boolean;
  /** The episode's result; throw `HandledEpisodeError` to fail it with a given failure. */
  run(request: EpisodeRequest, work: EpisodeWork): Promise<JsonObject>;
  /** Serves `POST /aggregate_metrics` when present. */
  aggregateMetrics?(body: JsonObject, signal: AbortSignal): Promise<JsonValue>;
}
