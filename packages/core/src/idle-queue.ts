/**
 * Work done ahead, in idle event-loop turns: items queue once each and are handed to `work` a
 * slice per turn, so a burst of thousands never holds the loop for long. Used to encode what a
 * checkpoint will export while nothing waits for it, instead of during the commit.
 */
/**
 * How long the servers let a session or an episode stay at its boundary, with admission open,
 * before they encode it ahead: a rollout's model and tool calls take milliseconds to seconds,
 * and a checkpoint that opens meanwhile hurries the rest (`IdleQueue.hurry`).
 */
export const ENCODE_AHEAD_SETTLE_MS = 1000;

export interface IdleQueueOptions {
  /** The most items worked in one turn. */
  readonly slice?: number;
  /**
   * How long an item waits in the queue before it is worked, unless `urgent()`: work ahead for an
   * item that leaves first (deleted) is never done. A rollout passes a boundary every few
   * milliseconds and almost never meets a checkpoint there; one that stays is worth the work.
   */
  readonly settleMs?: number;
  /** While true, items are worked in the next idle turn, settled or not (a checkpoint is open). */
  readonly urgent?: () => boolean;
}

export class IdleQueue<T> {
  /** Queued items, in queue order, with when each was queued. */
  readonly #items = new Map<T, number>();
  #scheduled: NodeJS.Immediate | NodeJS.Timeout | undefined;
  readonly #slice: number;
  readonly #settleMs: number;
  readonly #urgent: () => boolean;

  constructor(
    /** A promise it returns is not awaited (the next item starts at once); a rejection is ignored. */
    private readonly work: (item: T) => void | Promise<void>,
    { slice = 256, settleMs = 0, urgent = () => false }: IdleQueueOptions = {},
  ) {
    this.#slice = slice;
    this.#settleMs = settleMs;
    this.#urgent = urgent;
  }

  get size(): number {
    return this.#items.size;
  }

  /** Queues `item` (once: queuing it again keeps its place and its time). */
  add(item: T): void {
    if (this.#items.has(item)) return;
    this.#items.set(item, performance.now());
    this.#schedule(this.#urgent() ? 0 : this.#settleMs);
  }

  delete(item: T): void {
    this.#items.delete(item);
  }

  /** Works the queued items from the next idle turn on, settled or not (a checkpoint opened). */
  hurry(): void {
    if (this.#items.size === 0) return;
    // Settled now; setting a key again keeps its place.
    for (const item of this.#items.keys()) this.#items.set(item, -Infinity);
    this.#unschedule();
    this.#schedule(0);
  }

  #schedule(ms: number): void {
    if (this.#scheduled !== undefined) return;
    this.#scheduled =
      ms <= 0
        ? setImmediate(() => this.#runSlice())
        : // Work ahead never keeps a process alive.
          setTimeout(() => this.#runSlice(), ms).unref();
  }

  #unschedule(): void {
    if (this.#scheduled === undefined) return;
    const scheduled = this.#scheduled;
    // A Timeout can be refreshed, an Immediate cannot.
    if ('refresh' in scheduled) clearTimeout(scheduled);
    else clearImmediate(scheduled as NodeJS.Immediate);
    this.#scheduled = undefined;
  }

  #runSlice(): void {
    this.#scheduled = undefined;
    const urgent = this.#urgent();
    const now = performance.now();
    let done = 0;
    for (const [item, queuedAt] of this.#items) {
      if (done === this.#slice) break;
      // Queue order is time order: the first unsettled item ends the slice until it settles.
      if (!urgent && now - queuedAt < this.#settleMs) {
        this.#schedule(queuedAt + this.#settleMs - now);
        return;
      }
      this.#items.delete(item);
      done += 1;
      try {
        // Work done ahead is an optimisation: whoever needs its result does it again, and reports.
        void this.work(item)?.catch(() => undefined);
      } catch {
        // Ignored for the same reason.
      }
    }
    if (this.#items.size > 0) this.#schedule(0);
  }
}
