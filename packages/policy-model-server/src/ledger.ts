/**
 * The capture ledger: per capture key, in the capture directory, `<key>.lineage.jsonl` (one row
 * per delivered model call), a `<key>.lineage.retired` fence (presence = retired) and a
 * `<key>.lineage.started` marker (a restored attempt some server sharing the directory started).
 * Several policy servers may share one directory, so every change to a rollout's files happens
 * under that rollout's cross-process lock (proper-lockfile). Locks are striped: a rollout's lock
 * is `<dir>/.locks/stripe-<n>.lock`, n a hash of its rollout id, so one rollout always takes the
 * same lock and a batch of 16k rollouts takes at most LOCK_STRIPES locks instead of 16k (each a
 * mkdir and rmdir on disk).
 */
import * as fs from 'node:fs';
import { mkdir, open, readdir } from 'node:fs/promises';
import { join } from 'node:path';
import { setImmediate as yieldToLoop } from 'node:timers/promises';
import { promisify } from 'node:util';

import {
  decodeJson,
  encodeJson,
  forEachBounded,
  fsyncDirectory,
  type JsonObject,
  parseCaptureKey,
  RolloutRetiredError,
} from '@ckpt-gym/core';
import lockfile from 'proper-lockfile';

export const LEDGER_SUFFIX = '.lineage.jsonl';
export const FENCE_SUFFIX = '.lineage.retired';
export const STARTED_SUFFIX = '.lineage.started';
/** Token-store files a dead execution may leave; the restore's cleanup deletes them too. */
export const TOKEN_SUFFIXES = ['.tokens.jsonl', '.tokens.incomplete'] as const;
/** Every per-key file the restore's cleanup deletes, longest suffix first (none is a suffix of another). */
const CLEANUP_SUFFIXES = [LEDGER_SUFFIX, FENCE_SUFFIX, STARTED_SUFFIX, ...TOKEN_SUFFIXES];
export const LOCK_DIR = '.locks';
export const LOCK_STRIPES = 256;
/** Bounds parallel file work in a batch (file descriptors are shared with live connections). */
const BATCH_CONCURRENCY = 64;
/** Back-off while another process holds a stripe: polls up to every 50 ms, ~100 s in all. */
const LOCK_RETRIES = { retries: 2000, factor: 1.2, minTimeout: 1, maxTimeout: 50 };
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

/** Renames `from` to `to`; false when `from` does not exist. */
function renameNow(from: string, to: string): boolean {
  try {
    fs.renameSync(from, to);
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
 * Writes `text` as the whole content of `path`, in place: truncating a file that holds data to
 * zero (O_TRUNC) makes ext4 start writing it back on close, several times the cost of the write.
 */
function overwriteNow(path: string, text: string): void {
  const data = Buffer.from(text);
  const fd = fs.openSync(path, fs.constants.O_WRONLY | fs.constants.O_CREAT);
  try {
    for (let done = 0; done < data.length;) {
      done += fs.writeSync(fd, data, done, data.length - done, done);
    }
    fs.ftruncateSync(fd, data.length);
  } finally {
    fs.closeSync(fd);
  }
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
function validKeys(keys: readonly string[]): string[] {
  for (const key of keys) parseCaptureKey(key);
  return [...new Set(keys)];
}

/**
 * A ledger's rows as this process last wrote or read them, with the file's size and modification
 * time at that moment: while both still match, the file holds exactly these rows.
 */
interface KnownLedger {
  rows: JsonObject[];
  size: bigint;
  mtimeNs: bigint;
}

export class CaptureLedger {
  /**
   * Rows by key, so a commit's export reads a ledger file only when some other process changed it
   * since: one stat per key instead of a read and a parse (at 8k rollouts ~0.4 s of the commit).
   */
  readonly #known = new Map<string, KnownLedger>();
  /** In-process queue per stripe in front of the file lock, so one process never polls itself. */
  readonly #local = new Map<number, Promise<unknown>>();

  constructor(readonly dir: string) {}

  /** Creates the directory and its lock directory. */
  async init(): Promise<this> {
    await mkdir(join(this.dir, LOCK_DIR), { recursive: true });
    return this;
  }

  path(key: string, suffix: string): string {
    return join(this.dir, `${key}${suffix}`);
  }

  /** Runs `fn` holding the rollout's lock, in this process and across processes. */
  withRolloutLock<T>(rolloutId: string, fn: () => Promise<T>): Promise<T> {
    return this.#withStripe(lockStripe(rolloutId), fn);
  }

  #withStripe<T>(stripe: number, fn: () => Promise<T>): Promise<T> {
    const previous = this.#local.get(stripe) ?? Promise.resolve();
    const run = previous.then(async () => {
      // proper-lockfile registers locks by file path: one path per stripe, lock at `<path>.lock`.
      // One try first: a retrying lock computes its whole back-off schedule up front, which at a
      // batch's 256 stripes costs more than the locking; only a held stripe needs it.
      const path = join(this.dir, LOCK_DIR, `stripe-${stripe}`);
      const release = await lockfile.lock(path, { realpath: false }).catch((err: unknown) => {
        if ((err as NodeJS.ErrnoException).code !== 'ELOCKED') throw err;
        return lockfile.lock(path, { realpath: false, retries: LOCK_RETRIES });
      });
      try {
        return await fn();
      } finally {
        await release();
      }
    });
    const settled = run.then(
      () => undefined,
      () => undefined,
    );
    this.#local.set(stripe, settled);
    void settled.then(() => {
      if (this.#local.get(stripe) === settled) this.#local.delete(stripe);
    });
    return run;
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
      this.#withStripe(stripe, async () => {
        for (const item of list) await fn(item);
      }),
    );
  }

  /**
   * Appends one row, durably. A key whose ledger does not exist yet and that is fenced is retired:
   * the row is discarded ('discarded') instead of bringing the ledger back.
   */
  append(key: string, row: JsonObject): Promise<'written' | 'discarded'> {
    const line = `${encodeJson(row)}\n`;
    return this.#lockKey(key, async () => {
      const ledger = this.path(key, LEDGER_SUFFIX);
      const creating = !(await exists(ledger));
      if (creating && (await exists(this.path(key, FENCE_SUFFIX)))) return 'discarded';
      const handle = await open(ledger, 'a');
      try {
        await handle.write(line);
        await handle.sync();
        this.#extendKnown(key, line, creating, await handle.stat({ bigint: true }));
      } finally {
        await handle.close();
      }
      if (creating) await this.syncDirectory();
      return 'written';
    });
  }

  /** Keeps the appended row when the file grew by exactly its line since the rows we know. */
  #extendKnown(key: string, line: string, created: boolean, after: fs.BigIntStats): void {
    const known = created ? { rows: [], size: 0n, mtimeNs: 0n } : this.#known.get(key);
    this.#known.delete(key);
    if (known === undefined || known.size + BigInt(Buffer.byteLength(line)) !== after.size) return;
    known.rows.push(decodeJson(line.slice(0, -1)) as JsonObject);
    this.#remember(key, { rows: known.rows, size: after.size, mtimeNs: after.mtimeNs });
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
    return Promise.resolve(this.#rowsNow(key));
  }

  /**
   * The rows of each key (as `exportRows`), in order. Read synchronously in slices between
   * event-loop turns: a ledger is a page-cache read of a few kB, cheaper than the trip through the
   * libuv pool (at 8k ledgers about a third of the CPU of bounded-concurrency async reads), and
   * a slice blocks the loop for about a millisecond.
   */
  async exportMany(keys: readonly string[], signal?: AbortSignal): Promise<JsonObject[][]> {
    for (const key of keys) parseCaptureKey(key);
    const rows: JsonObject[][] = [];
    for (const key of keys) {
      if (rows.length % EXPORT_SLICE === 0) {
        await yieldToLoop();
        signal?.throwIfAborted();
      }
      rows.push(this.#rowsNow(key));
    }
    return rows;
  }

  /** The rows of `key`: the known ones while the file is unchanged, else read (and then known). */
  #rowsNow(key: string): JsonObject[] {
    const path = this.path(key, LEDGER_SUFFIX);
    const before = fs.statSync(path, { bigint: true, throwIfNoEntry: false });
    const known = this.#known.get(key);
    if (before === undefined) {
      this.#known.delete(key);
      return [];
    }
    if (known && known.size === before.size && known.mtimeNs === before.mtimeNs) {
      return [...known.rows];
    }
    let text: string;
    try {
      text = fs.readFileSync(path, 'utf8');
    } catch (err) {
      if (!isMissing(err)) throw err;
      this.#known.delete(key);
      return [];
    }
    const rows = parseRows(text);
    // Known only when nothing changed the file while it was read.
    if (Buffer.byteLength(text) === Number(before.size)) {
      this.#remember(key, { rows, size: before.size, mtimeNs: before.mtimeNs });
    } else {
      this.#known.delete(key);
    }
    return [...rows];
  }

  async isRetired(key: string): Promise<boolean> {
    return !(await exists(this.path(key, LEDGER_SUFFIX))) && exists(this.path(key, FENCE_SUFFIX));
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
   * Fences each key, then deletes its ledger and started marker, so no late row brings it back.
   * A key without a ledger is `absent` but still fenced. Two directory syncs per batch.
   */
  async retire(keys: readonly string[]): Promise<RolloutRemoval> {
    return this.#fenceAndReplace(validKeys(keys), new Map(), false);
  }

  /** Deletes each key's ledger, fence and started marker, so the key reads as unused again. */
  async delete(keys: readonly string[]): Promise<RolloutRemoval> {
    const unique = validKeys(keys);
    const removal: RolloutRemoval = { removed: [], absent: [] };
    await this.#underLocks(unique, rolloutOfKey, async (key) => {
      this.#known.delete(key);
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
   * (as `importMany`). Two passes, each taking a stripe's lock once: the fences a listing of the
   * directory does not show, one directory sync, then the listing (retaken if a fence was written)
   * drives every removal and the target writes (a target ledger a dead execution left is
   * overwritten in place, no unlink first; a new one is a retired ledger renamed and overwritten);
   * a last directory sync.
   */
  async restore(
    targets: ReadonlyMap<string, readonly JsonObject[]>,
    retired: readonly string[],
  ): Promise<RolloutRemoval> {
    for (const key of targets.keys()) parseCaptureKey(key);
    return this.#fenceAndReplace(validKeys(retired), targets, true);
  }

  async #fenceAndReplace(
    retired: readonly string[],
    targets: ReadonlyMap<string, readonly JsonObject[]>,
    listed: boolean,
  ): Promise<RolloutRemoval> {
    const work = new Map<string, RolloutWork>();
    const of = (rolloutId: string): RolloutWork => {
      let entry = work.get(rolloutId);
      if (!entry) work.set(rolloutId, (entry = { rolloutId, retired: [], targets: [] }));
      return entry;
    };
    for (const key of retired) of(rolloutOfKey(key)).retired.push(key);
    for (const key of targets.keys()) of(rolloutOfKey(key)).targets.push(key);
    const removal: RolloutRemoval = { removed: [], absent: [] };
    if (work.size === 0) return removal;
    const fenced = [...work.values()].filter((w) => w.retired.length > 0);
    let index = listed ? await this.listByRollout(work) : undefined;
    const has = (w: RolloutWork, name: string): boolean =>
      index === undefined || (index.get(w.rolloutId) ?? []).some((f) => f.name === name);
    // A listed fence needs no write: a delete removing it since then orders after this retire.
    const needsFence = (w: RolloutWork, key: string): boolean =>
      index === undefined || !has(w, key + FENCE_SUFFIX);
    const unfenced = fenced.filter((w) => w.retired.some((key) => needsFence(w, key)));
    await this.#underLocks(unfenced, rolloutOfWork, async (w) => {
      for (const key of w.retired) {
        if (needsFence(w, key)) createExclusiveNow(this.path(key, FENCE_SUFFIX));
      }
    });
    // The fences are durable before the rows they replace disappear (also one an overlapping
    // retire wrote and may not have synced yet).
    if (fenced.length > 0) await this.syncDirectory();
    // A fenced key gets no new ledger or marker unless a delete makes it reusable (and then what
    // it holds is not ours to drop), so a listing taken after every fence existed finds all the
    // files to remove; one taken before a fence this batch wrote may miss a ledger: list again.
    if (index !== undefined && unfenced.length > 0) index = await this.listByRollout(work);
    await this.#underLocks([...work.values()], rolloutOfWork, async (w) => {
      const files = index?.get(w.rolloutId) ?? [];
      // Retired keys whose ledger goes; a new target ledger takes over one of them by a rename,
      // cheaper than creating a file and unlinking one that holds data.
      const doomed: string[] = [];
      for (const key of w.retired) {
        const ledger = `${key}${LEDGER_SUFFIX}`;
        const started = `${key}${STARTED_SUFFIX}`;
        // A delete in between made the key reusable; a ledger it holds now is not ours to drop.
        if ((!has(w, ledger) && !has(w, started)) || !existsNow(this.path(key, FENCE_SUFFIX))) {
          removal.absent.push(key);
          continue;
        }
        if (has(w, started)) removeNow(join(this.dir, started));
        if (has(w, ledger)) doomed.push(key);
        else removal.absent.push(key);
      }
      if (w.targets.length > 0) {
        const from = Math.min(...w.targets.map((key) => parseCaptureKey(key).attempt));
        const written = new Set(
          w.targets
            .filter((key) => (targets.get(key) ?? []).length > 0)
            .map((k) => k + LEDGER_SUFFIX),
        );
        const stale = files.filter((f) => f.attempt >= from && !written.has(f.name));
        for (const f of stale) {
          const staleKey = keyOfFile(f.name);
          if (staleKey !== undefined) this.#known.delete(staleKey);
          removeNow(join(this.dir, f.name));
        }
      }
      for (const key of w.targets) {
        const rows = targets.get(key) ?? [];
        if (rows.length === 0) continue;
        const path = this.path(key, LEDGER_SUFFIX);
        const reused = has(w, key + LEDGER_SUFFIX) ? undefined : doomed.pop();
        if (reused !== undefined) {
          this.#known.delete(reused);
          const moved = renameNow(this.path(reused, LEDGER_SUFFIX), path);
          (moved ? removal.removed : removal.absent).push(reused);
        }
        this.#known.delete(key);
        overwriteNow(path, rows.map((row) => `${encodeJson(row)}\n`).join(''));
      }
      for (const key of doomed) {
        this.#known.delete(key);
        (removeNow(this.path(key, LEDGER_SUFFIX)) ? removal.removed : removal.absent).push(key);
      }
    });
    await this.syncDirectory();
    return sortRemoval(removal);
  }

  /** Syncs the directory, making its entries (fences, creations, removals) durable. */
  syncDirectory(): Promise<void> {
    return fsyncDirectory(this.dir);
  }

  /** One listing of the directory: the per-key files of `rollouts`, by rollout id. */
  async listByRollout(
    rollouts: ReadonlyMap<string, unknown>,
  ): Promise<Map<string, { name: string; attempt: number }[]>> {
    const index = new Map<string, { name: string; attempt: number }[]>();
    for (const name of await readdir(this.dir)) {
      const key = keyOfFile(name);
      if (key === undefined) continue;
      let episode;
      try {
        episode = parseCaptureKey(key);
      } catch {
        continue; // not a capture key: never ours to delete
      }
      if (!rollouts.has(episode.rollout_id)) continue;
      const list = index.get(episode.rollout_id) ?? [];
      list.push({ name, attempt: episode.attempt });
      index.set(episode.rollout_id, list);
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
      if (await exists(this.path(key, FENCE_SUFFIX))) return false;
      try {
        const handle = await open(
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
interface RolloutWork {
  rolloutId: string;
  retired: string[];
  targets: string[];
}

const rolloutOfWork = (work: RolloutWork): string => work.rolloutId;

function sortRemoval(removal: RolloutRemoval): RolloutRemoval {
  return { removed: removal.removed.sort(), absent: removal.absent.sort() };
}
