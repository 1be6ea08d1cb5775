/**
 * Work done ahead, in idle event-loop turns: items queue once each and are handed to `work` a
 * slice per turn, so a burst of thousands never holds the loop for long. Used to encode what a
 * checkpoint will export while nothing waits for it, instead of during the commit.
 */
export class IdleQueue<T> {
  readonly #items = new Set<T>();
  #scheduled = false;

  constructor(
    /** A promise it returns is not awaited (the next item starts at once); a rejection is ignored. */
    private readonly work: (item: T) => void | Promise<void>,
    private readonly slice = 256,
  ) {}

  get size(): number {
    return this.#items.size;
  }

  /** Queues `item` (once: queuing it again keeps its place). */
  add(item: T): void {
    this.#items.add(item);
    if (this.#scheduled) return;
    this.#scheduled = true;
    setImmediate(() => this.#runSlice());
  }

  delete(item: T): void {
    this.#items.delete(item);
  }

  #runSlice(): void {
    let done = 0;
    for (const item of this.#items) {
      if (done === this.slice) break;
      this.#items.delete(item);
      done += 1;
      try {
        // Work done ahead is an optimisation: whoever needs its result does it again, and reports.
        void this.work(item)?.catch(() => undefined);
      } catch {
        // Ignored for the same reason.
      }
    }
    if (this.#items.size > 0) setImmediate(() => this.#runSlice());
    else this.#scheduled = false;
  }
}
