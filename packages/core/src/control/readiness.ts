/**
 * The readiness wait of a prepare, outside the plane's lock: it looks again whenever the
 * participant reports a change, the plane's checkpoint changes (`wakeAll`), or at least every
 * READINESS_POLL_MS in case a notification was missed, until it should stop or the deadline passes.
 */
import type { Participant } from '../participant.js';
import type { ControlClock } from './deadline.js';

/** The readiness wait asks again at least this often, in case a change notification was missed. */
export const READINESS_POLL_MS = 1000;

export class ReadinessWaits {
  readonly #clock: ControlClock;
  readonly #waiters = new Set<() => void>();

  constructor(clock: ControlClock) {
    this.#clock = clock;
  }

  /** Every waiting prepare looks again (the checkpoint changed under it, or the plane stopped). */
  wakeAll(): void {
    for (const wake of [...this.#waiters]) wake();
  }

  /**
   * Resolves once `stop()` holds, the participant is ready or `deadlineTs` passed; rejects when
   * `signal` aborts (the client went away). Not being ready at the deadline is not an error.
   */
  async wait(
    participant: Pick<Participant, 'ready' | 'onChange'>,
    stop: () => boolean,
    deadlineTs: number,
    signal: AbortSignal | undefined,
  ): Promise<void> {
    for (;;) {
      if (signal?.aborted)
        throw signal.reason instanceof Error ? signal.reason : new Error('request aborted');
      if (stop() || participant.ready()) return;
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
        const unsubscribe = participant.onChange(wake);
        const cancelTimer = this.#clock.setTimeout(wake, Math.min(READINESS_POLL_MS, remainingMs));
        this.#waiters.add(wake);
        signal?.addEventListener('abort', wake, { once: true });
      });
    }
  }
}
