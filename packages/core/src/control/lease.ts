/**
 * The lease of one open checkpoint: each control call extends it (never earlier) to a grace past
 * its deadline; when the clock reaches it without a renewal, the expiry callback fires once. The
 * plane makes one per checkpoint and ends it when the checkpoint ends, so a timer of an earlier
 * checkpoint never reaches a later one.
 */
import { atTime, type ControlClock } from './deadline.js';
import { extendedLease } from './phases.js';

export class Lease {
  readonly #clock: ControlClock;
  readonly #graceSeconds: number;
  readonly #onExpiry: () => void;
  #expiresAt: number | null = null;
  #cancelTimer: (() => void) | null = null;
  #ended = false;

  constructor(clock: ControlClock, graceSeconds: number, onExpiry: () => void) {
    this.#clock = clock;
    this.#graceSeconds = graceSeconds;
    this.#onExpiry = onExpiry;
  }

  /** Epoch seconds; null before the first renewal. */
  get expiresAt(): number | null {
    return this.#expiresAt;
  }

  /** Extends the lease to `max(current, deadline + grace)` and re-arms its timer; returns the expiry. */
  renew(deadlineTs: number): number {
    const expiresAt = extendedLease(this.#expiresAt, deadlineTs, this.#graceSeconds);
    this.#expiresAt = expiresAt;
    this.#arm(() => atTime(this.#clock, expiresAt, this.#fire));
    return expiresAt;
  }

  /**
   * Whether the lease is past its end now. Asked after the callback, under the caller's lock: a
   * renewal may have come first, or the wall clock gone back; then the timer is armed again.
   */
  isExpired(): boolean {
    if (this.#ended || this.#expiresAt === null) return false;
    const expiresAt = this.#expiresAt;
    if (this.#clock.now() >= expiresAt) return true;
    this.#arm(() => atTime(this.#clock, expiresAt, this.#fire));
    return false;
  }

  /** Acting on the expiry failed: the callback fires again after `seconds` (unless renewed first). */
  retryIn(seconds: number): void {
    this.#arm(() => this.#clock.setTimeout(this.#fire, seconds * 1000));
  }

  /** Cancels the timer for good: the callback never fires after this (a renewal still extends). */
  end(): void {
    this.#ended = true;
    this.#cancelTimer?.();
    this.#cancelTimer = null;
  }

  #arm(schedule: () => () => void): void {
    this.#cancelTimer?.();
    this.#cancelTimer = this.#ended ? null : schedule();
  }

  readonly #fire = (): void => {
    this.#cancelTimer = null;
    if (!this.#ended) this.#onExpiry();
  };
}
