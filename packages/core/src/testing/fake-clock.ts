/**
 * A clock for control-plane tests: time moves only when the test advances it, and timers fire in
 * order as it passes them, so deadlines and leases are exercised without sleeping.
 */
import type { ControlClock } from '../control/deadline.js';

interface Timer {
  readonly at: number;
  readonly seq: number;
  readonly fn: () => void;
}

export class FakeClock implements ControlClock {
  #now: number;
  #seq = 0;
  #timers: Timer[] = [];

  constructor(start = 1_700_000_000) {
    this.#now = start;
  }

  now(): number {
    return this.#now;
  }

  setTimeout(fn: () => void, ms: number): () => void {
    const timer: Timer = { at: this.#now + Math.max(ms, 0) / 1000, seq: this.#seq++, fn };
    this.#timers.push(timer);
    return () => {
      this.#timers = this.#timers.filter((t) => t !== timer);
    };
  }

  /** Moves time forward by `seconds`, firing every timer due on the way, in order. */
  advance(seconds: number): void {
    const target = this.#now + seconds;
    for (;;) {
      const due = this.#timers
        .filter((t) => t.at <= target)
        .sort((a, b) => a.at - b.at || a.seq - b.seq)[0];
      if (!due) break;
      this.#timers = this.#timers.filter((t) => t !== due);
      this.#now = Math.max(this.#now, due.at);
      due.fn();
    }
    this.#now = target;
  }

  get pendingTimers(): number {
    return this.#timers.length;
  }
}

/** Lets pending promise callbacks and I/O callbacks run. */
export async function settle(rounds = 5): Promise<void> {
  for (let i = 0; i < rounds; i++) await new Promise<void>((resolve) => setImmediate(resolve));
}
