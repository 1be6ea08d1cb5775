/**
 * Holds and the gate: which calls wait before answering, and the FIFO of waiting calls that
 * release, step and opening the gate let go.
 */
import { InvalidRequestError } from '@ckpt-gym/core/protocol';

export interface HoldPolicy {
  /** Every call whose global index is ≥ n waits. */
  readonly after_calls: number | null;
  /** Every call of a rollout beyond that rollout's first n calls (over all its attempts) waits. */
  readonly after_calls_per_rollout: number | null;
  /**
   * A held call first generates this many tokens, then waits: it is in flight mid-generation, so
   * a generation cut captures those tokens. 0 waits before generating anything.
   */
  readonly after_tokens: number;
}

export const NO_HOLD: HoldPolicy = {
  after_calls: null,
  after_calls_per_rollout: null,
  after_tokens: 0,
};

/** Why a call waits; a hold outranks the gate because only release or step lets it go. */
export type WaitReason = 'hold' | 'gate';

export interface CallPosition {
  readonly index: number;
  /** Null for an untagged call, which no per-rollout hold applies to. */
  readonly rolloutCallIndex: number | null;
}

/** Whether a call arriving now waits, and why. Decided once, at arrival. */
export function waitReason(
  hold: HoldPolicy,
  gateClosed: boolean,
  call: CallPosition,
): WaitReason | null {
  if (hold.after_calls !== null && call.index >= hold.after_calls) return 'hold';
  if (
    hold.after_calls_per_rollout !== null &&
    call.rolloutCallIndex !== null &&
    call.rolloutCallIndex >= hold.after_calls_per_rollout
  ) {
    return 'hold';
  }
  return gateClosed ? 'gate' : null;
}

interface Waiter {
  readonly reason: WaitReason;
  readonly release: () => void;
}

export class WaitQueue {
  private holdPolicy: HoldPolicy = NO_HOLD;
  private closed = false;
  /** Oldest first. */
  private waiters: Waiter[] = [];

  get hold(): HoldPolicy {
    return this.holdPolicy;
  }

  get gateClosed(): boolean {
    return this.closed;
  }

  get waiting(): number {
    return this.waiters.length;
  }

  /** Replaces the hold; calls already waiting keep waiting (placing a hold twice releases nothing). */
  setHold(hold: HoldPolicy): void {
    this.holdPolicy = hold;
  }

  /** Opening the gate lets go of the calls that wait only for it; returns how many. */
  setGate(closed: boolean): number {
    this.closed = closed;
    if (closed) return 0;
    return this.releaseWhere((w) => w.reason === 'gate');
  }

  /** Clears the hold, opens the gate and lets every waiting call go; returns how many. */
  releaseAll(): number {
    this.holdPolicy = NO_HOLD;
    this.closed = false;
    return this.releaseWhere(() => true);
  }

  /** Lets the `n` oldest waiting calls go, whatever they wait for; returns how many. */
  step(n: number): number {
    const released = this.waiters.slice(0, n);
    this.waiters = this.waiters.slice(n);
    for (const w of released) w.release();
    return released.length;
  }

  reasonFor(call: CallPosition): WaitReason | null {
    return waitReason(this.holdPolicy, this.closed, call);
  }

  /**
   * Waits until released (true) or until `signal` aborts (false, and the call leaves the queue so
   * a later step does not spend itself on a call nobody is listening for).
   */
  wait(reason: WaitReason, signal: AbortSignal): Promise<boolean> {
    if (signal.aborted) return Promise.resolve(false);
    return new Promise((resolve) => {
      const onAbort = (): void => {
        this.waiters = this.waiters.filter((w) => w !== waiter);
        resolve(false);
      };
      const waiter: Waiter = {
        reason,
        release: () => {
          signal.removeEventListener('abort', onAbort);
          resolve(true);
        },
      };
      this.waiters.push(waiter);
      signal.addEventListener('abort', onAbort, { once: true });
    });
  }

  private releaseWhere(pick: (w: Waiter) => boolean): number {
    const released = this.waiters.filter(pick);
    this.waiters = this.waiters.filter((w) => !pick(w));
    for (const w of released) w.release();
    return released.length;
  }
}

// --- control bodies ---------------------------------------------------------------------------

/** A control body: a JSON object (an empty body counts as `{}`) with only the `allowed` keys. */
export function objectBody(
  body: unknown,
  route: string,
  allowed: readonly string[],
): Record<string, unknown> {
  const value = body ?? {};
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw new InvalidRequestError(`${route}: body must be a JSON object`);
  }
  const unknownKeys = Object.keys(value).filter((k) => !allowed.includes(k));
  if (unknownKeys.length > 0) {
    throw new InvalidRequestError(`${route}: unknown keys ${unknownKeys.join(', ')}`);
  }
  return value as Record<string, unknown>;
}

function countField(value: unknown, path: string): number {
  if (typeof value !== 'number' || !Number.isSafeInteger(value) || value < 0) {
    throw new InvalidRequestError(
      `${path}: must be a non-negative integer, got ${JSON.stringify(value)}`,
    );
  }
  return value;
}

function optionalCount(value: unknown, path: string): number | null {
  return value === undefined || value === null ? null : countField(value, path);
}

/** `{after_calls?, after_calls_per_rollout?, after_tokens?}`, at least one of the first two a count. */
export function parseHoldBody(body: unknown): HoldPolicy {
  const value = objectBody(body, '/_ctl/hold', [
    'after_calls',
    'after_calls_per_rollout',
    'after_tokens',
  ]);
  const hold: HoldPolicy = {
    after_calls: optionalCount(value.after_calls, 'after_calls'),
    after_calls_per_rollout: optionalCount(
      value.after_calls_per_rollout,
      'after_calls_per_rollout',
    ),
    after_tokens: optionalCount(value.after_tokens, 'after_tokens') ?? 0,
  };
  if (hold.after_calls === null && hold.after_calls_per_rollout === null) {
    throw new InvalidRequestError('/_ctl/hold: give after_calls or after_calls_per_rollout');
  }
  return hold;
}

/** `{closed?: boolean}`; an empty body closes the gate. */
export function parseGateBody(body: unknown): boolean {
  const { closed = true } = objectBody(body, '/_ctl/gate', ['closed']);
  if (typeof closed !== 'boolean') throw new InvalidRequestError('closed: must be a boolean');
  return closed;
}

/** `{calls?: n}`, default 1. */
export function parseStepBody(body: unknown): number {
  const { calls = 1 } = objectBody(body, '/_ctl/step', ['calls']);
  return countField(calls, 'calls');
}

/** `/_ctl/release` takes no fields. */
export function parseReleaseBody(body: unknown): void {
  objectBody(body, '/_ctl/release', []);
}

/** `{interval_ms: n}`; 0 turns keep-alive comments off. */
export function parseKeepAliveBody(body: unknown): number {
  const { interval_ms } = objectBody(body, '/_ctl/keepalive', ['interval_ms']);
  return countField(interval_ms, 'interval_ms');
}
