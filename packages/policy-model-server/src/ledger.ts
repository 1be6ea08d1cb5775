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
import { constants as fsConstants } from 'node:fs';
import { mkdir, open, readdir, readFile, stat, unlink, writeFile } from 'node:fs/promises';
import { join } from 'node:path';

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

export class CaptureLedger {
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
      const release = await lockfile.lock(join(this.dir, LOCK_DIR, `stripe-${stripe}`), {
        realpath: false,
        retries: { retries: 2000, factor: 1.2, minTimeout: 1, maxTimeout: 50 },
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
      } finally {
        await handle.close();
      }
      if (creating) await fsyncDirectory(this.dir);
      return 'written';
    });
  }

  /** Every row of `key`, in order; none when it has no ledger. */
  async exportRows(key: string): Promise<JsonObject[]> {
    parseCaptureKey(key);
    let text: string;
    try {
      text = await readFile(this.path(key, LEDGER_SUFFIX), 'utf8');
    } catch (err) {
      if (isMissing(err)) return [];
      throw err;
    }
    return text
      .split('\n')
      .filter((line) => line !== '')
      .map((line) => decodeJson(line) as JsonObject);
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
    const unique = validKeys(keys);
    if (unique.length === 0) return { removed: [], absent: [] };
    await this.#underLocks(unique, rolloutOfKey, async (key) => {
      try {
        await writeFile(this.path(key, FENCE_SUFFIX), '', { flag: 'wx' });
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
      }
    });
    // The fences are durable before the rows they replace disappear (also one an overlapping
    // retire wrote and may not have synced yet).
    await fsyncDirectory(this.dir);
    const removal: RolloutRemoval = { removed: [], absent: [] };
    await this.#underLocks(unique, rolloutOfKey, async (key) => {
      // A delete in between made the key reusable; a ledger it holds now is not ours to drop.
      if (!(await exists(this.path(key, FENCE_SUFFIX)))) {
        removal.absent.push(key);
        return;
      }
      const removed = await remove(this.path(key, LEDGER_SUFFIX));
      await remove(this.path(key, STARTED_SUFFIX));
      (removed ? removal.removed : removal.absent).push(key);
    });
    await fsyncDirectory(this.dir);
    return sortRemoval(removal);
  }

  /** Deletes each key's ledger, fence and started marker, so the key reads as unused again. */
  async delete(keys: readonly string[]): Promise<RolloutRemoval> {
    const unique = validKeys(keys);
    const removal: RolloutRemoval = { removed: [], absent: [] };
    await this.#underLocks(unique, rolloutOfKey, async (key) => {
      const removed = await remove(this.path(key, LEDGER_SUFFIX));
      await remove(this.path(key, FENCE_SUFFIX));
      await remove(this.path(key, STARTED_SUFFIX));
      (removed ? removal.removed : removal.absent).push(key);
    });
    if (unique.length > 0) await fsyncDirectory(this.dir);
    return sortRemoval(removal);
  }

  /**
   * Installs restored ledgers: for each target key, first deletes what dead executions left for
   * that attempt and every later attempt of its rollout (ledgers, fences, started markers, token
   * files), then writes exactly `rows` as the target's ledger. One directory listing, indexed by
   * rollout; files are not synced one by one (the checkpoint is the durable copy); one directory
   * sync for the batch.
   */
  async importMany(targets: ReadonlyMap<string, readonly JsonObject[]>): Promise<void> {
    const byRollout = new Map<string, { key: string; attempt: number }[]>();
    for (const key of targets.keys()) {
      const e = parseCaptureKey(key);
      const list = byRollout.get(e.rollout_id) ?? [];
      list.push({ key, attempt: e.attempt });
      byRollout.set(e.rollout_id, list);
    }
    const index = await this.listByRollout(byRollout);
    await this.#underLocks(
      [...byRollout],
      ([rolloutId]) => rolloutId,
      async ([rolloutId, wanted]) => {
        const from = Math.min(...wanted.map((w) => w.attempt));
        const stale = (index.get(rolloutId) ?? []).filter((f) => f.attempt >= from);
        await Promise.all(stale.map((f) => remove(join(this.dir, f.name))));
        for (const { key } of wanted) {
          const rows = targets.get(key) ?? [];
          if (rows.length === 0) continue;
          await writeFile(
            this.path(key, LEDGER_SUFFIX),
            rows.map((row) => `${encodeJson(row)}\n`).join(''),
          );
        }
      },
    );
    if (targets.size > 0) await fsyncDirectory(this.dir);
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
          fsConstants.O_CREAT | fsConstants.O_EXCL | fsConstants.O_WRONLY,
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

function sortRemoval(removal: RolloutRemoval): RolloutRemoval {
  return { removed: removal.removed.sort(), absent: removal.absent.sort() };
}
