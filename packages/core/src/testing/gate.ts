/** A promise the test opens (or fails) by hand, to hold a handler or a hook where it is. */
export class Gate {
  readonly promise: Promise<void>;
  #open!: () => void;
  #fail!: (err: Error) => void;
  #settled = false;

  constructor() {
    this.promise = new Promise<void>((resolve, reject) => {
      this.#open = resolve;
      this.#fail = reject;
    });
    // A failed gate nobody awaits yet must not fail the test run as an unhandled rejection.
    this.promise.catch(() => undefined);
  }

  /** Opened or failed. */
  get settled(): boolean {
    return this.#settled;
  }

  /** Opens the gate (a method, not a field, so `gate.open` can be handed on as a callback). */
  readonly open = (): void => {
    this.#settled = true;
    this.#open();
  };

  fail(err: Error): void {
    this.#settled = true;
    this.#fail(err);
  }
}
