/**
 * The capture ledger: per capture key, in the capture directory, `<key>.lineage.jsonl` (one row
 * per delivered model call), a `<key>.lineage.retired` fence (presence = retired; an empty one is
 * a hard link to `.locks/fence`, or what was the key's ledger after a plain retire) and a
 * `<key>.lineage.started` marker (a restored attempt some server sharing the directory started).
 * Per rollout, a `<rollout id>.rollout.retired` fence holding an attempt (decimal): every attempt
 * up to it is retired, with or without a per-key fence. A retire through attempt N spanning more
 * than a few unfenced attempts raises it, so it writes O(1) files, never one per earlier attempt.
 * Several policy servers may share one directory, so every change to a rollout's files happens
 * under that rollout's cross-process lock (proper-lockfile). Locks are striped: a rollout's lock
 * is `<dir>/.locks/stripe-<n>.lock`, n a hash of its rollout id, so one rollout always takes the
 * same lock and a batch of 16k rollouts takes at most LOCK_STRIPES locks instead of 16k (each a
 * mkdir and rmdir on disk). A retire or restore batch holds all its stripes at once, taken in
 * ascending order.
 */
import * as fs from 'node:fs';
import { mkdir, open as openHandle, readdir } from 'node:fs/promises';
import { join, sep } from 'node:path';
import { setImmediate as yieldToLoop } from 'node:timers/promises';
import { promisify } from 'node:util';

import {
  captureKey,
  decodeJson,
  encodeJson,
  type EpisodeId,
  type JsonObject,
  parseCaptureKey,
  RolloutRetiredError,
} from '@ckpt-gym/core/protocol';
import { forEachBounded, fsyncDirectory } from '@ckpt-gym/core/server';
import lockfile from 'proper-lockfile';

export const LEDGER_SUFFIX = '.lineage.jsonl';
export const FENCE_SUFFIX = '.lineage.retired';
export const STARTED_SUFFIX = '.lineage.started';
/** `<rollout id>.rollout.retired`: the rollout's attempts up to the one it holds are retired. */
export const ROLLOUT_FENCE_SUFFIX = '.rollout.retired';
/** Written first and renamed over the rollout fence, so a reader never sees a partial number. */
const ROLLOUT_FENCE_TEMP_SUFFIX = `${ROLLOUT_FENCE_SUFFIX}.tmp`;
/** Bytes read of a rollout fence: the digits of the highest attempt and a newline, with room. */
const ROLLOUT_FENCE_MAX_BYTES = 32;
/**
 * Attempts above a rollout's fence a retire through N fences one by one, as before rollout fences
 * (links, no inode: see `#fenceNow`); more raise the rollout fence and list the directory.
 */
const THROUGH_PROBE_WINDOW = 16;
/** Token-store files a dead execution may leave; the restore's cleanup deletes them too. */
export const TOKEN_SUFFIXES = ['.tokens.jsonl', '.tokens.incomplete'] as const;
/** Every per-key file the restore's cleanup deletes, longest suffix first (none is a suffix of another). */
const CLEANUP_SUFFIXES = [LEDGER_SUFFIX, FENCE_SUFFIX, STARTED_SUFFIX, ...TOKEN_SUFFIXES];
export const LOCK_DIR = '.locks';
/** The empty file in LOCK_DIR that fences are hard links to. */
const SHARED_FENCE = 'fence';
/**
 * Stripes: a batch of many rollouts (a restore) takes every one, each lock a directory created
 * and removed (~1 ms of kernel time each on the 2-core machine's ext4 with `discard`): at 2,000
 * restored rollouts 256 stripes cost 170–320 ms of kernel CPU, 64 cost 100–135 ms, 32 about as
 * much as 64. Appends of different rollouts sharing a stripe queue in-process for one write.
 */
export const LOCK_STRIPES = 64;
/** Bounds parallel file work in a batch (file descriptors are shared with live connections). */
const BATCH_CONCURRENCY = 64;
/** Rollouts a retire or restore batch works through per event-loop turn (a few calls each). */
const BATCH_SLICE = 32;
/** Back-off while another process holds a stripe: polls up to every 50 ms, ~100 s in all. */
const LOCK_RETRIES = { retries: 2000, factor: 1.2, minTimeout: 1, maxTimeout: 50 };
/**
 * A lock whose mtime is older than this is a dead holder's, and taken over. Its holder refreshes
 * it every LOCK_UPDATE_MS on a timer, so the threshold is what a holder's event loop may lag: at
 * 16,000 rollouts on two cores (load average 15) proper-lockfile's 10 s was passed, a worker's
 * held lock was taken over and its write failed. The price is the wait for a lock a crashed
 * holder left, at most this long, and only when it crashed while holding one (mid-append).
 */
const LOCK_STALE_MS = 30_000;
const LOCK_UPDATE_MS = 1000;

/** Runs a synchronous file call and answers its callback on the next tick, as an async one would. */
function callNow<T>(call: () => T, callback: (err: unknown, value?: T) => void): void {
  let value: T;
  try {
    value = call();
  } catch (err) {
    process.nextTick(callback, err);
    return;
  }
  process.nextTick(callback, null, value);
}

/**
 * The file calls proper-lockfile makes. A lock is alive while its mtime is fresh, so the stat that
 * reads it and the utimes that refreshes it (the holder's heartbeat, and the probe right after
 * taking it) run at once, never behind the libuv pool's queue: 8,000 rollouts' durable appends
 * queue there for longer than the stale threshold, and a holder whose heartbeat waited behind
 * them lost its lock to another worker mid-write (ENOENT on its own lock). Both are metadata calls
 * of microseconds; mkdir and rmdir (about a millisecond each with `discard`) stay in the pool.
 */
const LOCK_FS = {
  mkdir: fs.mkdir,
  rmdir: fs.rmdir,
  realpath: fs.realpath,
  stat: (path: string, callback: (err: unknown, stats?: fs.Stats) => void) =>
    callNow(() => fs.statSync(path), callback),
  utimes: (path: string, atime: Date, mtime: Date, callback: (err: unknown) => void) =>
    callNow(() => fs.utimesSync(path, atime, mtime), callback),
};
/** Ledgers read per event-loop turn in an export (each a few system calls). */
const EXPORT_SLICE = 64;
/** Ledgers whose rows this process keeps in memory (the most recently written or read). */
const KNOWN_LEDGERS_MAX = 65_536;

/** What a retire or delete did: ledgers it removed, keys that had none. */
export interface RolloutRemoval {
  removed: string[];
  absent: string[];
}

/** A manifest read of a retired key: 410 `rollout_retired`. */
export class LedgerRetiredError extends RolloutRetiredError {
  constructor(readonly key: string) {
    super(`capture ledger ${key} is retired`);
  }
}

export interface LedgerManifest {
  rollout_id: string;
  records: JsonObject[];
  failures: { model_call_id: unknown; reason: unknown }[];
}

// The callback API on plain descriptors: fs/promises wraps every opened file in a FileHandle,
// which at thousands of files costs several times the system calls themselves (and GC).
const stat = promisify(fs.stat);
const unlink = promisify(fs.unlink);
const open = promisify(fs.open);
const write = promisify(fs.write);

// Under a stripe's lock a batch's file work runs synchronously: these calls take tens of
// microseconds on a local disk, less than each one's trip through the libuv pool and back (at 8k
// rollouts the hand-offs cost more than the calls), and a stripe's share of a batch blocks the
// event loop for about a millisecond.
function existsNow(path: string): boolean {
  return fs.statSync(path, { throwIfNoEntry: false }) !== undefined;
}

function removeNow(path: string): boolean {
  try {
    fs.unlinkSync(path);
    return true;
  } catch (err) {
    if (isMissing(err)) return false;
    throw err;
  }
}

/** Creates an empty file unless it exists. */
function createExclusiveNow(path: string): void {
  try {
    fs.closeSync(fs.openSync(path, 'wx'));
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
  }
}

/**
 * A file's content: a string, or pieces written one after another. Either goes to the kernel as
 * it is (a string encoded natively, pieces as one gathered write), not copied into a buffer first.
 */
type FileText = string | readonly Uint8Array[];

/** One byte, read past what `overwriteNow` wrote to learn whether the file goes on. */
const PROBE = Buffer.alloc(1);

/**
 * Writes `text` as the whole content of `path`, in place: truncating a file that holds data to
 * zero (O_TRUNC) makes ext4 start writing it back on close, several times the cost of the write.
 * Only a file that was longer than `text` is cut to its length: a truncate to the size the file
 * already has still updates its inode (a journal entry each). Whether it was longer is a one-byte
 * read past the text, not an fstat: node 20 builds a Stats object with four Dates per fstat (at
 * 16,000 restored rollouts 200 ms of the policy model's restore CPU, and its garbage).
 */
function overwriteNow(path: string, text: FileText): void {
  const fd = fs.openSync(path, fs.constants.O_RDWR | fs.constants.O_CREAT);
  try {
    const length = writeAllNow(fd, text);
    if (fs.readSync(fd, PROBE, 0, 1, length) > 0) fs.ftruncateSync(fd, length);
  } finally {
    fs.closeSync(fd);
  }
}

/** Creates `path` holding `text`; it must not exist yet. */
function createNow(path: string, text: FileText): void {
  const fd = fs.openSync(path, fs.constants.O_WRONLY | fs.constants.O_CREAT | fs.constants.O_EXCL);
  try {
    writeAllNow(fd, text);
  } finally {
    fs.closeSync(fd);
  }
}

/** A ledger opened to append: every write lands at the end, its data on disk when it returns. */
const APPEND_FLAGS = fs.constants.O_WRONLY | fs.constants.O_APPEND | fs.constants.O_DSYNC;

/** Opens an existing ledger to append (a path lookup); undefined when there is none. */
function openToAppendNow(path: string): number | undefined {
  try {
    return fs.openSync(path, APPEND_FLAGS);
  } catch (err) {
    if (isMissing(err)) return undefined;
    throw err;
  }
}

/**
 * Writes `text` from the start of `fd`; returns its length in bytes. libuv completes a short
 * write itself (it writes on from where the kernel stopped), so fewer bytes means a failed one.
 */
function writeAllNow(fd: number, text: FileText): number {
  const [done, length] =
    typeof text === 'string'
      ? [fs.writeSync(fd, text, 0), Buffer.byteLength(text)]
      : [fs.writevSync(fd, text as Uint8Array[], 0), byteLengthOf(text)];
  if (done !== length) throw new Error(`wrote ${done} of ${length} bytes of a ledger file`);
  return length;
}

function byteLengthOf(pieces: readonly Uint8Array[]): number {
  let length = 0;
  for (const piece of pieces) length += piece.byteLength;
  return length;
}

/** The highest attempt `path` (a rollout fence) retires, or -1 when there is none. */
function readRolloutFenceNow(path: string): number {
  let fd: number;
  try {
    fd = fs.openSync(path, 'r');
  } catch (err) {
    if (isMissing(err)) return -1;
    throw err;
  }
  const buffer = Buffer.alloc(ROLLOUT_FENCE_MAX_BYTES);
  let length: number;
  try {
    length = fs.readSync(fd, buffer, 0, buffer.length, 0);
  } finally {
    fs.closeSync(fd);
  }
  const text = buffer.toString('latin1', 0, length);
  const attempt = Number(text.trimEnd());
  if (!/^(0|[1-9][0-9]*)\n?$/.test(text) || !Number.isSafeInteger(attempt)) {
    throw new Error(`rollout fence ${path} does not hold an attempt number`);
  }
  return attempt;
}

/** Replaces the rollout fence at `path` with `attempt`, atomically (a temporary file renamed). */
function writeRolloutFenceNow(path: string, attempt: number): void {
  const temp = path.slice(0, -ROLLOUT_FENCE_SUFFIX.length) + ROLLOUT_FENCE_TEMP_SUFFIX;
  overwriteNow(temp, `${attempt}\n`);
  fs.renameSync(temp, path);
}

function isMissing(err: unknown): boolean {
  return (err as NodeJS.ErrnoException).code === 'ENOENT';
}

async function exists(path: string): Promise<boolean> {
  try {
    await stat(path);
    return true;
  } catch (err) {
    if (isMissing(err)) return false;
    throw err;
  }
}

/** Unlinks `path`; true when it existed. */
async function remove(path: string): Promise<boolean> {
  try {
    await unlink(path);
    return true;
  } catch (err) {
    if (isMissing(err)) return false;
    throw err;
  }
}

/**
 * A ledger's rows as their JSON texts, each exactly what the codec writes for its row (a
 * checkpoint record's rows as read back): installed as they are, nothing decoded or encoded.
 * `rows[i]` is row i's text in pieces (its text as read, or that text without its closing brace
 * and a stamp shared by every row of the record), so the ledger file is one concatenation of
 * them, not a copy of each row first.
 */
export class RowTexts {
  constructor(readonly rows: readonly (readonly Uint8Array[])[]) {}

  get length(): number {
    return this.rows.length;
  }
}

/** The rows a restore installs under a target: rows (encoded here) or their texts. */
export type LedgerTarget = readonly JsonObject[] | RowTexts;

const NEWLINE = Buffer.from('\n');

/** A target's ledger file: one row's JSON per line. */
function ledgerFileText(rows: LedgerTarget): FileText {
  if (!(rows instanceof RowTexts)) return rows.map((row) => `${encodeJson(row)}\n`).join('');
  const parts: Uint8Array[] = [];
  for (const pieces of rows.rows) {
    for (const piece of pieces) parts.push(piece);
    parts.push(NEWLINE);
  }
  return parts;
}

function parseRows(text: string): JsonObject[] {
  return text
    .split('\n')
    .filter((line) => line !== '')
    .map((line) => decodeJson(line) as JsonObject);
}

/** The capture key a ledger-directory file belongs to, if it is one of ours. */
export function keyOfFile(name: string): string | undefined {
  for (const suffix of CLEANUP_SUFFIXES) {
    if (name.endsWith(suffix)) return name.slice(0, -suffix.length);
  }
  return undefined;
}

/** Valid capture keys, deduplicated; the whole batch is refused (400) if any key is invalid. */
function validKeys(keys: readonly string[], parsed = new ParsedKeys()): string[] {
  for (const key of keys) parsed.of(key);
  return [...new Set(keys)];
}

/**
 * A batch's capture keys, each parsed (and so validated) once, though a restore looks each up
 * about six times (its rollout, its attempt in the retire, the donor choice and the install).
 */
class ParsedKeys {
  readonly #episodes = new Map<string, EpisodeId>();

  /** The key's episode; an invalid key throws as `parseCaptureKey`. */
  of(key: string): EpisodeId {
    let episode = this.#episodes.get(key);
    if (episode === undefined) this.#episodes.set(key, (episode = parseCaptureKey(key)));
    return episode;
  }

  attempt(key: string): number {
    return this.of(key).attempt;
  }

  /** The lowest attempt of `keys` (not empty). */
  first(keys: readonly string[]): number {
    let lowest = Infinity;
    for (const key of keys) lowest = Math.min(lowest, this.attempt(key));
    return lowest;
  }
}

/**
 * A ledger's rows as this process last wrote or read them, with the file's size and modification
 * time at that moment: while both still match, the file holds exactly these rows.
 */
interface KnownLedger {
  rows: JsonObject[];
  /** `encodeJson` of each row, once needed (a commit writes them); kept up to date by appends. */
  lines: string[] | undefined;
  size: bigint;
  mtimeNs: bigint;
}

/** One key's rows as a process that appended them knows them, for another to export. */
export interface AppendedLedger {
  readonly key: string;
  readonly rows: readonly JsonObject[];
  /** The codec's text of each row (`lines[i]` encodes `rows[i]`). */
  readonly lines: readonly string[];
  /** The file as these rows were known: equal stamps of one key mean the same rows. */
  readonly stamp: string;
}

function appendedLedger(key: string, known: KnownLedger, lines: string[]): AppendedLedger {
  const stamp = `${known.size}:${known.mtimeNs}:${known.rows.length}`;
  return { key, rows: known.rows, lines, stamp };
}

/** A ledger's rows, with the JSON text the codec writes for each (`lines[i]` encodes `rows[i]`). */
export interface LedgerRows {
  rows: JsonObject[];
  lines: string[];
}

export class CaptureLedger {
  /**
   * Rows by key, so a commit's export reads a ledger file only when some other process changed it
   * since: one stat per key instead of a read and a parse (at 8k rollouts ~0.4 s of the commit).
   */
  readonly #known = new Map<string, KnownLedger>();
  /**
   * In-process queue per stripe in front of the file lock, so one process never polls itself:
   * each holder's turn, which settles when it lets the stripe go.
   */
  readonly #local = new Map<number, Promise<void>>();
  /**
   * Whether this ledger has taken a stripe yet. proper-lockfile learns the file system's mtime
   * precision at a process's first lock, with a utimes and a stat, and every lock taken before
   * it knows probes too: a fresh server's first batch (its restore) made 64 probes instead of one.
   */
  #lockedOnce = false;
  /** The empty file fences are hard links to (see `#fenceNow`). */
  readonly #sharedFence: string;
  /**
   * The directory with a trailing separator: a file of ours is the prefix and its name (a capture
   * key's characters make one path segment), without `join` normalizing it again on every call
   * (a restore of 8k rollouts names ~50k paths).
   */
  readonly #prefix: string;

  /** Options of every stripe lock (its stale threshold: tests shorten it). */
  readonly #lockOptions: lockfile.LockOptions;

  constructor(
    readonly dir: string,
    options: {
      lockStaleMs?: number;
      /** Told when a held stripe lock was taken over (by default a process warning). */
      onLockLost?: (err: Error) => void;
    } = {},
  ) {
    this.#lockOptions = {
      realpath: false,
      stale: options.lockStaleMs ?? LOCK_STALE_MS,
      update: LOCK_UPDATE_MS,
      fs: LOCK_FS,
      // proper-lockfile's default throws from a timer, ending the process and every call in it.
      onCompromised:
        options.onLockLost ??
        ((err) => process.emitWarning(`capture ledger: a stripe lock was lost: ${err.message}`)),
    };
    this.#sharedFence = join(dir, LOCK_DIR, SHARED_FENCE);
    this.#prefix = join(dir, sep);
  }

  /** Creates the directory and its lock directory. */
  async init(): Promise<this> {
    await mkdir(join(this.dir, LOCK_DIR), { recursive: true });
    return this;
  }

  path(key: string, suffix: string): string {
    return `${this.#prefix}${key}${suffix}`;
  }

  rolloutFencePath(rolloutId: string): string {
    return `${this.#prefix}${rolloutId}${ROLLOUT_FENCE_SUFFIX}`;
  }

  /** True when `key` has a fence of its own or its rollout's fence reaches its attempt. */
  #fencedNow(key: string): boolean {
    if (existsNow(this.path(key, FENCE_SUFFIX))) return true;
    const { rollout_id, attempt } = parseCaptureKey(key);
    return readRolloutFenceNow(this.rolloutFencePath(rollout_id)) >= attempt;
  }

  /**
   * A retire through `w.through`: the keys to fence one by one, those of the attempts above the
   * rollout's fence when they are at most THROUGH_PROBE_WINDOW; else undefined, having raised the
   * rollout's fence to `w.through` (it never goes down here).
   */
  #fenceThroughNow(w: RolloutWork, noFence: boolean): string[] | undefined {
    if (w.through < 0) return [];
    const path = this.rolloutFencePath(w.rolloutId);
    const fence = noFence ? -1 : readRolloutFenceNow(path);
    const keys = attemptKeys(w.rolloutId, fence + 1, w.through);
    if (keys === undefined) writeRolloutFenceNow(path, w.through);
    return keys;
  }

  /** Lowers the rollout's fence below `attempt` (removes it at 0), so `attempt` is unfenced. */
  #lowerRolloutFenceNow(rolloutId: string, attempt: number): void {
    const path = this.rolloutFencePath(rolloutId);
    if (readRolloutFenceNow(path) < attempt) return;
    if (attempt === 0) removeNow(path);
    else writeRolloutFenceNow(path, attempt - 1);
  }

  /** Runs `fn` holding the rollout's lock, in this process and across processes. */
  withRolloutLock<T>(rolloutId: string, fn: () => Promise<T>): Promise<T> {
    return this.#withStripes([lockStripe(rolloutId)], fn);
  }

  /**
   * Runs `fn` holding every one of `stripes` (distinct), in ascending order: a holder only ever
   * waits for a stripe above all those it holds, so two batches, in this process or across
   * processes, never wait for each other in a circle. Each round tries every stripe left at once
   * (a try never waits, so holding any set meanwhile is safe), keeps the run of stripes up to the
   * first it did not get and lets the rest go, then waits for that one.
   */
  async #withStripes<T>(stripes: readonly number[], fn: () => Promise<T>): Promise<T> {
    const order = [...stripes].sort((a, b) => a - b);
    const held: (() => Promise<void>)[] = [];
    try {
      while (held.length < order.length) {
        // The first round of the first batch tries one stripe: the precision is known after it.
        const next = this.#lockedOnce ? order.length : held.length + 1;
        const tries = await Promise.allSettled(
          order.slice(held.length, next).map((stripe) => this.#acquire(stripe, false)),
        );
        this.#lockedOnce = true;
        let missed: (typeof tries)[number] | undefined;
        const spare: (() => Promise<void>)[] = [];
        for (const tried of tries) {
          const release = tried.status === 'fulfilled' ? tried.value : undefined;
          if (missed === undefined && release !== undefined) held.push(release);
          else if (release !== undefined) spare.push(release);
          else missed ??= tried;
        }
        if (missed === undefined) continue;
        await Promise.all(spare.map((release) => release()));
        if (missed.status === 'rejected') throw missed.reason;
        held.push((await this.#acquire(order[held.length]!, true))!);
      }
      return await fn();
    } finally {
      await Promise.all(held.map((release) => release()));
    }
  }

  /**
   * Takes a stripe: its turn in this process's queue, then the file lock. Resolves to the release;
   * without `wait`, to undefined at once if some holder (here or in another process) has it.
   */
  async #acquire(stripe: number, wait: boolean): Promise<(() => Promise<void>) | undefined> {
    const previous = this.#local.get(stripe);
    if (previous && !wait) return undefined;
    let leave!: () => void;
    const mine = new Promise<void>((resolve) => (leave = resolve));
    const turn = (previous ?? Promise.resolve()).then(() => mine);
    this.#local.set(stripe, turn);
    void turn.then(() => {
      if (this.#local.get(stripe) === turn) this.#local.delete(stripe);
    });
    await previous;
    try {
      // proper-lockfile registers locks by file path: one path per stripe, lock at `<path>.lock`.
      // One try first: a retrying lock computes its whole back-off schedule up front, which at a
      // batch's 256 stripes costs more than the locking; only a held stripe needs it.
      const path = join(this.dir, LOCK_DIR, `stripe-${stripe}`);
      const options = this.#lockOptions;
      const unlock = await lockfile.lock(path, options).catch((err: unknown) => {
        if ((err as NodeJS.ErrnoException).code !== 'ELOCKED') throw err;
        return wait ? lockfile.lock(path, { ...options, retries: LOCK_RETRIES }) : undefined;
      });
      if (unlock === undefined) {
        leave();
        return undefined;
      }
      return async () => {
        try {
          await unlock();
        } catch (err) {
          // A lock taken over is no longer ours to release (`onLockLost` was told).
          if ((err as NodeJS.ErrnoException).code !== 'ERELEASED') throw err;
        } finally {
          leave();
        }
      };
    } catch (err) {
      leave();
      throw err;
    }
  }

  #lockKey<T>(key: string, fn: () => Promise<T>): Promise<T> {
    return this.withRolloutLock(parseCaptureKey(key).rollout_id, fn);
  }

  /** Runs `fn` for every item under its rollout's lock, taking each stripe's lock once. */
  async #underLocks<T>(
    items: readonly T[],
    rolloutOf: (item: T) => string,
    fn: (item: T) => Promise<void>,
  ): Promise<void> {
    const stripes = new Map<number, T[]>();
    for (const item of items) {
      const stripe = lockStripe(rolloutOf(item));
      const list = stripes.get(stripe) ?? [];
      list.push(item);
      stripes.set(stripe, list);
    }
    await forEachBounded([...stripes], BATCH_CONCURRENCY, ([stripe, list]) =>
      this.#withStripes([stripe], async () => {
        for (const item of list) await fn(item);
      }),
    );
  }

  /**
   * Appends one row, durably. A key whose ledger does not exist yet and that is fenced is retired:
   * the row is discarded ('discarded') instead of bringing the ledger back. The ledger is opened
   * with O_DSYNC, so one write both appends the row and waits until its data is on disk: one trip
   * through the libuv pool instead of five (open, write, sync, stat, close). Only calls that can
   * wait for the file system's journal go through the pool; the open of an existing file (which
   * also tells whether it exists, no stat first), the stat and the close are in-memory work and
   * run here.
   */
  append(key: string, row: JsonObject): Promise<'written' | 'discarded'> {
    const data = Buffer.from(`${encodeJson(row)}\n`);
    return this.#lockKey(key, async () => {
      const ledger = this.path(key, LEDGER_SUFFIX);
      let fd = openToAppendNow(ledger);
      const creating = fd === undefined;
      if (creating && this.#fencedNow(key)) return 'discarded';
      fd ??= await open(ledger, APPEND_FLAGS | fs.constants.O_CREAT);
      try {
        for (let done = 0; done < data.length;) {
          done += (await write(fd, data, done, data.length - done)).bytesWritten;
        }
        this.#extendKnown(key, data, creating, fs.fstatSync(fd, { bigint: true }));
      } finally {
        fs.closeSync(fd);
      }
      if (creating) await this.syncDirectory();
      return 'written';
    });
  }

  /** Keeps the appended row when the file grew by exactly its line since the rows we know. */
  #extendKnown(key: string, line: Buffer, created: boolean, after: fs.BigIntStats): void {
    const known = created ? { rows: [], lines: [], size: 0n, mtimeNs: 0n } : this.#known.get(key);
    this.#known.delete(key);
    if (known === undefined || known.size + BigInt(line.length) !== after.size) return;
    const text = line.toString('utf8', 0, line.length - 1);
    known.rows.push(decodeJson(text) as JsonObject);
    known.lines?.push(text);
    this.#remember(key, { ...known, size: after.size, mtimeNs: after.mtimeNs });
  }

  #remember(key: string, known: KnownLedger): void {
    this.#known.delete(key);
    this.#known.set(key, known);
    if (this.#known.size > KNOWN_LEDGERS_MAX) {
      const oldest = this.#known.keys().next().value;
      if (oldest !== undefined) this.#known.delete(oldest);
    }
  }

  /** Every row of `key`, in order; none when it has no ledger. */
  exportRows(key: string): Promise<JsonObject[]> {
    parseCaptureKey(key);
    return Promise.resolve([...this.#knownNow(key).rows]);
  }

  /**
   * The rows of each key (as `exportRows`) with their JSON, in order: a commit writes the text
   * of rows this process appended instead of encoding them again. Read synchronously in slices
   * between event-loop turns: a ledger is a page-cache read of a few kB, cheaper than the trip
   * through the libuv pool (at 8k ledgers about a third of the CPU of bounded-concurrency async
   * reads), and a slice blocks the loop for about a millisecond.
   */
  async exportMany(keys: readonly string[], signal?: AbortSignal): Promise<LedgerRows[]> {
    for (const key of keys) parseCaptureKey(key);
    const out: LedgerRows[] = [];
    for (const key of keys) {
      if (out.length % EXPORT_SLICE === 0) {
        await yieldToLoop();
        signal?.throwIfAborted();
      }
      const known = this.#knownNow(key);
      known.lines ??= known.rows.map((row) => encodeJson(row));
      out.push({ rows: [...known.rows], lines: [...known.lines] });
    }
    return out;
  }

  /**
   * The rows, with the codec's text of each, of those of `keys`' ledgers this process knows with
   * their lines (it appended every row, or encoded them for an export), while the file is still
   * as it knew it (one stat each): another process sharing the directory exports them without
   * reading a file or encoding a row (a policy worker hands them to its coordinator at commit).
   * Keys it does not know so, or whose file changed since, are left out: the caller reads those.
   * The rows are not copies: read them before this ledger changes.
   */
  appendedNow(keys: readonly string[]): AppendedLedger[] {
    const out: AppendedLedger[] = [];
    for (const key of keys) {
      const known = this.#known.get(key);
      if (known?.lines === undefined || known.rows.length === 0) continue;
      const now = fs.statSync(this.path(key, LEDGER_SUFFIX), {
        bigint: true,
        throwIfNoEntry: false,
      });
      if (now?.size !== known.size || now.mtimeNs !== known.mtimeNs) continue;
      out.push(appendedLedger(key, known, known.lines));
    }
    return out;
  }

  /**
   * Every ledger this process knows with its lines, as it knew it: no file is looked at, so a
   * caller checks them later with `appendedNow` (equal stamps: the same rows).
   */
  knownAppended(): AppendedLedger[] {
    const out: AppendedLedger[] = [];
    for (const [key, known] of this.#known) {
      if (known.lines !== undefined && known.rows.length > 0) {
        out.push(appendedLedger(key, known, known.lines));
      }
    }
    return out;
  }

  /** What `key` holds: the known rows while the file is unchanged, else read (and then known). */
  #knownNow(key: string): Pick<KnownLedger, 'rows' | 'lines'> {
    const path = this.path(key, LEDGER_SUFFIX);
    const before = fs.statSync(path, { bigint: true, throwIfNoEntry: false });
    const known = this.#known.get(key);
    if (before === undefined) {
      this.#known.delete(key);
      return { rows: [], lines: [] };
    }
    if (known && known.size === before.size && known.mtimeNs === before.mtimeNs) return known;
    let text: string;
    try {
      text = fs.readFileSync(path, 'utf8');
    } catch (err) {
      if (!isMissing(err)) throw err;
      this.#known.delete(key);
      return { rows: [], lines: [] };
    }
    // Lines another writer left are encoded again when needed: only the codec's text is ours.
    const read: KnownLedger = {
      rows: parseRows(text),
      lines: undefined,
      size: before.size,
      mtimeNs: before.mtimeNs,
    };
    // Known only when nothing changed the file while it was read.
    if (Buffer.byteLength(text) === Number(before.size)) this.#remember(key, read);
    else this.#known.delete(key);
    return read;
  }

  async isRetired(key: string): Promise<boolean> {
    return !(await exists(this.path(key, LEDGER_SUFFIX))) && this.#fencedNow(key);
  }

  /** The key's rows split into records and failures; a retired key is `LedgerRetiredError`. */
  async manifest(key: string): Promise<LedgerManifest> {
    const rows = await this.exportRows(key);
    if (rows.length === 0 && (await this.isRetired(key))) throw new LedgerRetiredError(key);
    return {
      rollout_id: key,
      records: rows.filter((row) => row.failure_reason === undefined),
      failures: rows
        .filter((row) => row.failure_reason !== undefined)
        .map((row) => ({ model_call_id: row.model_call_id, reason: row.failure_reason })),
    };
  }

  /**
   * Retires each key so no late row brings its ledger back: the ledger becomes the fence (one
   * rename; the fence keeps the retired rows for inspection until a delete), a key without one
   * gets an empty fence and is `absent`; its started marker goes. One directory sync per batch.
   */
  async retire(keys: readonly string[]): Promise<RolloutRemoval> {
    const parsed = new ParsedKeys();
    return this.#retireAndInstall(validKeys(keys, parsed), new Map(), [], parsed);
  }

  /**
   * Retires every attempt of each episode's rollout up to the episode's, as `retire` of each
   * when the attempts above the rollout's fence are at most THROUGH_PROBE_WINDOW. Past that it
   * raises the rollout's fence (one file, whatever the attempt), lists the directory once, retires
   * the ledgers those attempts hold and fences the named attempt on its own too: the cost follows
   * the files on disk and the request, never the attempt number.
   */
  async retireThrough(episodes: readonly EpisodeId[]): Promise<RolloutRemoval> {
    return this.#retireAndInstall([], new Map(), episodes);
  }

  /**
   * Deletes each key's ledger, fence and started marker, so the key reads as unused again (a
   * rollout fence reaching the key is lowered below it).
   */
  async delete(keys: readonly string[]): Promise<RolloutRemoval> {
    const unique = validKeys(keys);
    const removal: RolloutRemoval = { removed: [], absent: [] };
    await this.#underLocks(unique, rolloutOfKey, async (key) => {
      this.#known.delete(key);
      const { rollout_id, attempt } = parseCaptureKey(key);
      this.#lowerRolloutFenceNow(rollout_id, attempt);
      const removed = await remove(this.path(key, LEDGER_SUFFIX));
      await remove(this.path(key, FENCE_SUFFIX));
      await remove(this.path(key, STARTED_SUFFIX));
      (removed ? removal.removed : removal.absent).push(key);
    });
    if (unique.length > 0) await this.syncDirectory();
    return sortRemoval(removal);
  }

  /**
   * Installs restored ledgers: for each target key, first deletes what dead executions left for
   * that attempt and every later attempt of its rollout (ledgers, fences, started markers, token
   * files), then writes exactly `rows` as the target's ledger. Files are not synced one by one
   * (the checkpoint is the durable copy); one directory sync for the batch.
   */
  async importMany(targets: ReadonlyMap<string, readonly JsonObject[]>): Promise<void> {
    await this.restore(targets, []);
  }

  /**
   * A restore's ledger work in one batch: retires `retired` (as `retire`) and installs `targets`
   * (as `importMany`) and retires through each of `through` (as `retireThrough`), holding all
   * the batch's stripes at once, so one listing of the directory is exact for the whole batch. A
   * target's rollout fence is lowered below it. A target ledger a dead execution left is
   * overwritten in place (no unlink first); a new one is created. One directory sync at the end.
   *
   * Per restored rollout this is two directory entries (the continued attempt's fence, a link;
   * its ledger renamed to the target's) and one open, write, fstat, close: the least per-key
   * files allow, as the bench's floor does it. Measured alone at 8,000 keys on the 2-core
   * machine: link ~125 ms and rename ~135 ms of kernel CPU, open+write+close ~50 ms; a new file
   * instead of the rename 200 ms to 3.3 s (inode allocation with `discard`), O_TRUNC instead of
   * the fstat ~350 ms. Fewer calls need fewer files per key (one file for a restore's rows and
   * fences), not a different order of these.
   */
  async restore(
    targets: ReadonlyMap<string, LedgerTarget>,
    retired: readonly string[],
    through: readonly EpisodeId[] = [],
  ): Promise<RolloutRemoval> {
    const parsed = new ParsedKeys();
    for (const key of targets.keys()) parsed.of(key);
    return this.#retireAndInstall(validKeys(retired, parsed), targets, through, parsed);
  }

  async #retireAndInstall(
    retired: readonly string[],
    targets: ReadonlyMap<string, LedgerTarget>,
    through: readonly EpisodeId[],
    parsed = new ParsedKeys(),
  ): Promise<RolloutRemoval> {
    const work = new Map<string, RolloutWork>();
    const of = (rolloutId: string): RolloutWork => {
      let entry = work.get(rolloutId);
      if (!entry)
        work.set(rolloutId, (entry = { rolloutId, retired: [], through: -1, targets: [] }));
      return entry;
    };
    for (const key of retired) of(parsed.of(key).rollout_id).retired.push(key);
    for (const e of through) {
      const w = of(e.rollout_id);
      w.through = Math.max(w.through, e.attempt);
    }
    for (const key of targets.keys()) of(parsed.of(key).rollout_id).targets.push(key);
    const removal: RolloutRemoval = { removed: [], absent: [] };
    if (work.size === 0) return removal;
    const stripes = [...new Set([...work.keys()].map(lockStripe))];
    // The batch's directory sync starts once its last change is made and runs while its stripes
    // are let go (it was after the release already; now the two overlap).
    let synced: Promise<void> | undefined;
    const batch = this.#withStripes(stripes, async () => {
      // With every stripe held no other server creates or removes files of these rollouts, so
      // what the batch finds stays true until it is done. A target's later attempts are unknown:
      // list the directory once; a retire alone looks at its keys' files (cheaper than listing a
      // directory of many rollouts for a few keys).
      let index = targets.size > 0 ? await this.listByRollout(work) : undefined;
      const fencedBefore: string[] = [];
      let done = 0;
      for (const w of work.values()) {
        if (++done % BATCH_SLICE === 0) await yieldToLoop();
        // A listing shows whether the rollout has a fence: no open per rollout to find out.
        let noFence = index !== undefined && !index.rolloutFences.has(w.rolloutId);
        const fenced = this.#fenceThroughNow(w, noFence);
        if (fenced === undefined) {
          noFence = false; // it raised the fence
          index ??= await this.listByRollout(work);
        }
        // The listing's map of the rollout is its own: this turn keeps it up to date.
        const files = index
          ? (index.files.get(w.rolloutId) ?? new Map<string, number>())
          : this.#probeNow([...w.retired, ...(fenced ?? [])], parsed);
        const more = fenced ?? keysThrough(w, files);
        w.retired =
          w.retired.length === 0 ? [...new Set(more)] : [...new Set([...w.retired, ...more])];
        const donors = donorsFor(w, targets, files, parsed);
        const donating = new Set(donors.values());
        for (const key of w.retired) {
          const attempt = parsed.attempt(key);
          this.#retireNow(key, attempt, files, removal, fencedBefore, donating.has(key));
        }
        if (w.targets.length === 0) continue;
        const from = parsed.first(w.targets);
        if (!noFence) this.#lowerRolloutFenceNow(w.rolloutId, from);
        this.#installNow(w.targets, from, targets, files, donors);
      }
      if (fencedBefore.length > 0) {
        // A fence an earlier retire stopped after (before removing the ledger) may not be durable
        // yet: it is, before the rows it replaces go.
        await this.syncDirectory();
        for (const key of fencedBefore) {
          this.#known.delete(key);
          (removeNow(this.path(key, LEDGER_SUFFIX)) ? removal.removed : removal.absent).push(key);
        }
      }
      synced = this.syncDirectory();
    });
    await batch.catch(async (err: unknown) => {
      await synced?.catch(() => undefined);
      throw err;
    });
    await synced;
    return sortRemoval(removal);
  }

  /** The files of `keys` on disk (ledger, fence, started marker), name to attempt. */
  #probeNow(keys: readonly string[], parsed: ParsedKeys): Map<string, number> {
    const files = new Map<string, number>();
    for (const key of keys) {
      const attempt = parsed.attempt(key);
      for (const suffix of [LEDGER_SUFFIX, FENCE_SUFFIX, STARTED_SUFFIX]) {
        if (existsNow(this.path(key, suffix))) files.set(key + suffix, attempt);
      }
    }
    return files;
  }

  /**
   * Retires `key` given its rollout's `files` (kept up to date): a ledger without a fence is
   * renamed to the fence, atomically, so there is never a moment with neither and a crash leaves
   * the key live or retired, never ledger-less and unfenced. A key holding both is left to
   * `fencedBefore`. A `donating` key is fenced first and keeps its ledger file for `#installNow`
   * to move to the target it continues as.
   */
  #retireNow(
    key: string,
    attempt: number,
    files: Map<string, number>,
    removal: RolloutRemoval,
    fencedBefore: string[],
    donating: boolean,
  ): void {
    const ledger = key + LEDGER_SUFFIX;
    const fence = key + FENCE_SUFFIX;
    if (files.delete(key + STARTED_SUFFIX)) removeNow(this.path(key, STARTED_SUFFIX));
    if (!files.has(ledger)) {
      if (!files.has(fence)) this.#fenceNow(key);
      files.set(fence, attempt);
      removal.absent.push(key);
    } else if (files.has(fence)) {
      fencedBefore.push(key);
    } else if (donating) {
      this.#known.delete(key);
      this.#fenceNow(key);
      files.set(fence, attempt);
      removal.removed.push(key);
    } else {
      this.#known.delete(key);
      fs.renameSync(this.path(key, LEDGER_SUFFIX), this.path(key, FENCE_SUFFIX));
      files.delete(ledger);
      files.set(fence, attempt);
      removal.removed.push(key);
    }
  }

  /**
   * Removes the files of the rollout's attempts from `from` (its lowest target) on from `files`
   * and disk, except the target ledgers about to be written, then writes the targets that have
   * rows: in place of a target's own file, the ledger file of its donor (see `donorsFor`), else a
   * new one.
   */
  #installNow(
    keys: readonly string[],
    from: number,
    targets: ReadonlyMap<string, LedgerTarget>,
    files: Map<string, number>,
    donors: ReadonlyMap<string, string>,
  ): void {
    const written = new Set(
      keys.filter((key) => (targets.get(key) ?? []).length > 0).map((k) => k + LEDGER_SUFFIX),
    );
    for (const [name, attempt] of files) {
      if (attempt < from || written.has(name)) continue;
      const staleKey = keyOfFile(name);
      if (staleKey !== undefined) this.#known.delete(staleKey);
      removeNow(this.#prefix + name);
      files.delete(name);
    }
    for (const key of keys) {
      const rows = targets.get(key) ?? [];
      if (rows.length === 0) continue;
      this.#known.delete(key);
      const text = ledgerFileText(rows);
      const ledger = this.path(key, LEDGER_SUFFIX);
      const donor = donors.get(key);
      if (donor !== undefined) {
        fs.renameSync(this.path(donor, LEDGER_SUFFIX), ledger);
        files.delete(donor + LEDGER_SUFFIX);
      }
      if (donor !== undefined || files.has(key + LEDGER_SUFFIX)) overwriteNow(ledger, text);
      else createNow(ledger, text);
    }
  }

  /**
   * Creates `key`'s empty fence unless it exists, as a hard link to one shared empty file: a
   * directory entry and no new inode. On ext4 mounted with `discard`, allocating 8k inodes just
   * after other files were deleted took 1.6 s instead of 0.25 s. A shared file that is missing, or
   * that has as many links as the file system allows, is replaced (fences linked to it keep it);
   * where hard links fail otherwise, the fence is a file of its own.
   */
  #fenceNow(key: string): void {
    const fence = this.path(key, FENCE_SUFFIX);
    const shared = this.#sharedFence;
    for (let round = 0; round < 2; round++) {
      try {
        fs.linkSync(shared, fence);
        return;
      } catch (err) {
        const code = (err as NodeJS.ErrnoException).code;
        if (code === 'EEXIST') return;
        if (round > 0 || (code !== 'ENOENT' && code !== 'EMLINK')) break;
        if (code === 'EMLINK') removeNow(shared);
        createExclusiveNow(shared);
      }
    }
    createExclusiveNow(fence);
  }

  /** Syncs the directory, making its entries (fences, creations, removals) durable. */
  syncDirectory(): Promise<void> {
    return fsyncDirectory(this.dir);
  }

  /** One listing of the directory: the per-key files of `rollouts` and which have a rollout fence. */
  async listByRollout(rollouts: ReadonlyMap<string, unknown>): Promise<DirectoryIndex> {
    const index: DirectoryIndex = { files: new Map(), rolloutFences: new Set() };
    for (const name of await readdir(this.dir)) {
      if (name.endsWith(ROLLOUT_FENCE_SUFFIX)) {
        const rolloutId = name.slice(0, -ROLLOUT_FENCE_SUFFIX.length);
        if (rollouts.has(rolloutId)) index.rolloutFences.add(rolloutId);
        continue;
      }
      const key = keyOfFile(name);
      if (key === undefined) continue;
      let episode;
      try {
        episode = parseCaptureKey(key);
      } catch {
        continue; // not a capture key: never ours to delete
      }
      if (!rollouts.has(episode.rollout_id)) continue;
      let names = index.files.get(episode.rollout_id);
      if (names === undefined) index.files.set(episode.rollout_id, (names = new Map()));
      names.set(name, episode.attempt);
    }
    return index;
  }

  /**
   * Marks a restored attempt started, exclusively and under its rollout's lock, so a server
   * sharing this directory keeps its ledger. Not synced: other servers only need to see it, and a
   * restore after a crash deletes it. A retired key is never marked (false).
   */
  markStarted(key: string): Promise<boolean> {
    return this.#lockKey(key, async () => {
      if (this.#fencedNow(key)) return false;
      try {
        const handle = await openHandle(
          this.path(key, STARTED_SUFFIX),
          fs.constants.O_CREAT | fs.constants.O_EXCL | fs.constants.O_WRONLY,
        );
        await handle.close();
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
      }
      return true;
    });
  }

  /**
   * Deletes the ledger of a restored attempt no server started, without a fence (the controller
   * may still start the rollout over as that attempt). Keeps it (false) when it has a started marker.
   */
  deleteUnstarted(key: string): Promise<boolean> {
    return this.#lockKey(key, async () => {
      if (await exists(this.path(key, STARTED_SUFFIX))) return false;
      this.#known.delete(key);
      await remove(this.path(key, LEDGER_SUFFIX));
      return true;
    });
  }
}

/**
 * For each of a rollout's targets that gets rows and has no ledger file yet, a retired key of the
 * same rollout, earlier than all its targets, holding an unfenced ledger (the latest such attempt
 * first): the restore fences that key and renames its ledger file to the target's instead of
 * creating a file, so a restore of N rollouts allocates no inodes (see `#fenceNow`).
 */
function donorsFor(
  w: RolloutWork,
  targets: ReadonlyMap<string, LedgerTarget>,
  files: ReadonlyMap<string, number>,
  parsed: ParsedKeys,
): Map<string, string> {
  const donors = new Map<string, string>();
  if (w.targets.length === 0) return donors;
  const first = parsed.first(w.targets);
  const candidates = w.retired
    .map((key) => ({ key, attempt: parsed.attempt(key) }))
    .filter(
      ({ key, attempt }) =>
        attempt < first && files.has(key + LEDGER_SUFFIX) && !files.has(key + FENCE_SUFFIX),
    )
    .sort((a, b) => b.attempt - a.attempt);
  for (const target of w.targets) {
    if ((targets.get(target) ?? []).length === 0 || files.has(target + LEDGER_SUFFIX)) continue;
    const donor = candidates.shift();
    if (donor === undefined) break;
    donors.set(target, donor.key);
  }
  return donors;
}

/** The lock stripe of a rollout: FNV-1a of its id, modulo LOCK_STRIPES (stable across processes). */
export function lockStripe(rolloutId: string): number {
  let hash = 0x811c9dc5;
  for (let i = 0; i < rolloutId.length; i++) {
    hash ^= rolloutId.charCodeAt(i);
    hash = Math.imul(hash, 0x01000193) >>> 0;
  }
  return hash % LOCK_STRIPES;
}

const rolloutOfKey = (key: string): string => parseCaptureKey(key).rollout_id;

/** One rollout's share of a restore or retire batch. */
/** What one listing of the ledger directory found for the rollouts it was asked about. */
export interface DirectoryIndex {
  /** Per-key files (ledgers, fences, started markers, token files) by rollout id: name to attempt. */
  files: Map<string, Map<string, number>>;
  /** The rollouts that have a rollout fence. */
  rolloutFences: Set<string>;
}

interface RolloutWork {
  rolloutId: string;
  /** Keys retired one by one. */
  retired: string[];
  /** The attempt a retire through it names, -1 for none. */
  through: number;
  targets: string[];
}

/**
 * The keys of the rollout's attempts `from..to`: none when `from > to`, undefined when they are
 * more than THROUGH_PROBE_WINDOW.
 */
function attemptKeys(rolloutId: string, from: number, to: number): string[] | undefined {
  if (to - from + 1 > THROUGH_PROBE_WINDOW) return undefined;
  const keys: string[] = [];
  for (let attempt = from; attempt <= to; attempt++) {
    keys.push(captureKey({ rollout_id: rolloutId, attempt }));
  }
  return keys;
}

/**
 * What a retire through `w.through` that raised the rollout fence retires one by one: the named
 * attempt (fenced on its own) and every earlier attempt with a file in `files`.
 */
function keysThrough(w: RolloutWork, files: ReadonlyMap<string, number>): string[] {
  if (w.through < 0) return [];
  const keys = [captureKey({ rollout_id: w.rolloutId, attempt: w.through })];
  for (const [name, attempt] of files) {
    const key = keyOfFile(name);
    if (key !== undefined && attempt <= w.through) keys.push(key);
  }
  return keys;
}

function sortRemoval(removal: RolloutRemoval): RolloutRemoval {
  return { removed: removal.removed.sort(), absent: removal.absent.sort() };
}
