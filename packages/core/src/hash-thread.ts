/**
 * SHA-256 in a thread of its own, so a commit's hashing overlaps its encoding and copying instead
 * of following them on the event loop: on a 2-core machine the hash of a 350 MB commit is ~0.3 s
 * of the main thread's ~0.45 s. One worker serves every hash of the process; it keeps the process
 * alive only while a hash is open. Starting it costs ~40 ms of CPU (a busy machine: ~90 ms), so a
 * process that commits starts it ahead (`startHashThread`), not in its first commit.
 */
import { Worker } from 'node:worker_threads';

/**
 * The worker: one hash per id, updated with the bytes it is sent (their memory transferred, so
 * nothing is copied), each update answered in order with the same memory, transferred back; the
 * digest sent when asked.
 */
const WORKER_SOURCE = `
const { parentPort } = require('node:worker_threads');
const { createHash } = require('node:crypto');
const hashes = new Map();
parentPort.on('message', ({ id, bytes }) => {
  let hash = hashes.get(id);
  if (hash === undefined) hashes.set(id, (hash = createHash('sha256')));
  if (bytes !== undefined) {
    hash.update(bytes);
    parentPort.postMessage({ id, bytes }, [bytes.buffer]);
  } else {
    hashes.delete(id);
    parentPort.postMessage({ id, digest: hash.digest('hex') });
  }
});
`;

interface Reply {
  id: number;
  bytes?: Uint8Array;
  digest?: string;
}

interface Waiter {
  resolve(reply: Reply): void;
  reject(err: unknown): void;
}

/** The process's hashing worker and the replies each open hash waits for, in order. */
class HashWorker {
  readonly #worker = new Worker(WORKER_SOURCE, { eval: true });
  readonly #waiting = new Map<number, Waiter[]>();
  #nextId = 0;
  #failure: unknown;

  constructor(onGone: () => void) {
    this.#worker.on('message', (reply: Reply) =>
      this.#waiting.get(reply.id)?.shift()?.resolve(reply),
    );
    const fail = (err: unknown) => {
      this.#failure ??= err;
      onGone();
      for (const waiters of this.#waiting.values())
        for (const w of waiters.splice(0)) w.reject(err);
    };
    this.#worker.on('error', fail);
    this.#worker.on('exit', (code) => fail(new Error(`the hashing thread exited (code ${code})`)));
    // After the listeners: a 'message' listener refs the worker again.
    this.#worker.unref();
  }

  open(): number {
    if (this.#failure !== undefined) throw this.#failure as Error;
    const id = this.#nextId++;
    if (this.#waiting.size === 0) this.#worker.ref();
    this.#waiting.set(id, []);
    return id;
  }

  /** Sends `bytes` (their memory transferred) or, without them, asks for the digest. */
  send(id: number, bytes?: Uint8Array): Promise<Reply> {
    if (this.#failure !== undefined) return Promise.reject(this.#failure as Error);
    return new Promise<Reply>((resolve, reject) => {
      this.#waiting.get(id)!.push({ resolve, reject });
      if (bytes === undefined) this.#worker.postMessage({ id });
      else this.#worker.postMessage({ id, bytes }, [bytes.buffer as ArrayBuffer]);
    });
  }

  /** Stops waiting for the hash's replies; one never digested is dropped by the worker too. */
  close(id: number, digested: boolean): void {
    if (!digested && this.#failure === undefined) this.#worker.postMessage({ id });
    this.#waiting.delete(id);
    if (this.#waiting.size === 0) this.#worker.unref();
  }
}

let shared: HashWorker | undefined;

function hashWorker(): HashWorker {
  const worker = (shared ??= new HashWorker(() => {
    // A worker that failed is replaced for the next hash.
    if (shared === worker) shared = undefined;
  }));
  return worker;
}

/** Starts the process's hashing thread now if it is not running, so no commit waits for it. */
export function startHashThread(): void {
  hashWorker();
}

/** Whether the process's hashing thread is running (or starting). */
export function hashThreadStarted(): boolean {
  return shared !== undefined;
}

/**
 * An incremental SHA-256 computed by the hashing thread, updates hashed in the order they are
 * made. `update` moves the bytes' memory to that thread (a Buffer from `allocUnsafeSlow`: it owns
 * its ArrayBuffer, which is detached here) and resolves to the same bytes once they are hashed.
 */
export class ThreadedSha256 {
  readonly #worker = hashWorker();
  readonly #id = this.#worker.open();
  #digested = false;
  #closed = false;

  async update(bytes: Uint8Array): Promise<Buffer> {
    const { bytes: back } = await this.#worker.send(this.#id, bytes);
    return Buffer.from(back!.buffer, back!.byteOffset, back!.byteLength);
  }

  /** The hex digest of everything updated; the hash is closed. */
  async digest(): Promise<string> {
    this.#digested = true;
    try {
      const { digest } = await this.#worker.send(this.#id);
      return digest!;
    } finally {
      this.close();
    }
  }

  /** Drops the hash, digested or not (a failed write's); idempotent. */
  close(): void {
    if (this.#closed) return;
    this.#closed = true;
    this.#worker.close(this.#id, this.#digested);
  }
}
