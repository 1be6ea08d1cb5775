/** An async mutex: callers of `run` queue in arrival order and run one at a time. */
export class Mutex {
  #tail: Promise<void> = Promise.resolve();

  async run<T>(fn: () => Promise<T>): Promise<T> {
    const previous = this.#tail;
    let release!: () => void;
    this.#tail = new Promise<void>((done) => (release = done));
    await previous;
    try {
      return await fn();
    } finally {
      release();
    }
  }
}
