/**
 * A collection's directory (`run --checkpoint-dir`): the dispatch log `dispatched.jsonl`, the
 * collector's pid `collector.pid`, one directory per checkpoint (the participants' records,
 * `controller.json`, then `collection.json`), and `LATEST`, which names the newest published
 * checkpoint: writing it is what publishes one.
 */
import { existsSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { appendFile, rm } from 'node:fs/promises';
import { join } from 'node:path';

import type { EpisodeId } from '@ckpt-gym/core/protocol';

import { writeDurably } from '../publication.js';
import { entriesToRemove } from './retention.js';
import {
  type CollectionManifest,
  type DispatchLog,
  type LogHead,
  logHeadLine,
  logLine,
  parseCollectionManifest,
  parseDispatchLog,
} from './resume.js';

export const DISPATCH_LOG = 'dispatched.jsonl';
export const LATEST_FILE = 'LATEST';
export const MANIFEST_FILE = 'collection.json';
export const PID_FILE = 'collector.pid';

/** Whether a process with `pid` exists (signal 0 checks without sending anything). */
export function processAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

function readIfThere(path: string): string | undefined {
  return existsSync(path) ? readFileSync(path, 'utf8') : undefined;
}

export class CollectionDir {
  constructor(readonly root: string) {}

  get logPath(): string {
    return join(this.root, DISPATCH_LOG);
  }

  get pidPath(): string {
    return join(this.root, PID_FILE);
  }

  /** The previous leg's log, or undefined when no run wrote one here. */
  readLog(): DispatchLog | undefined {
    const text = readIfThere(this.logPath);
    return text === undefined ? undefined : parseDispatchLog(text, this.logPath);
  }

  /** Replaces the previous leg's log with this leg's: its head, then the `carried` attempts. */
  async startLog(head: LogHead, carried: readonly EpisodeId[]): Promise<void> {
    await writeDurably(this.logPath, [logHeadLine(head), ...carried.map(logLine)].join(''));
  }

  /** Appended before the send: a killed collector leaves it behind (no fsync needed for that). */
  async logSend(episode: EpisodeId): Promise<void> {
    await appendFile(this.logPath, logLine(episode));
  }

  /** The checkpoint `LATEST` names, with its manifest; undefined when none was published. */
  latest(): { dir: string; manifest: CollectionManifest } | undefined {
    const pointer = readIfThere(join(this.root, LATEST_FILE))?.trim();
    if (pointer === undefined || pointer === '') return undefined;
    const dir = join(this.root, pointer);
    const path = join(dir, MANIFEST_FILE);
    const text = readIfThere(path);
    if (text === undefined)
      throw new Error(`${LATEST_FILE} names ${pointer}, which has no ${path}`);
    return { dir, manifest: parseCollectionManifest(text, path) };
  }

  /** Writes the manifest, points LATEST at it (publishing it), then drops what retention drops. */
  async publish(manifest: CollectionManifest): Promise<string> {
    const dir = join(this.root, manifest.checkpoint_id);
    await writeDurably(join(dir, MANIFEST_FILE), `${JSON.stringify(manifest, null, 2)}\n`);
    await writeDurably(join(this.root, LATEST_FILE), `${manifest.checkpoint_id}\n`);
    for (const name of entriesToRemove(this.entries())) {
      await rm(join(this.root, name), { recursive: true, force: true });
    }
    return dir;
  }

  /** A fresh run: an earlier run's checkpoints here must never be restored into it. */
  reset(): void {
    rmSync(join(this.root, LATEST_FILE), { force: true });
    for (const entry of this.entries()) {
      if (entry.createdAt !== undefined) rmSync(join(this.root, entry.name), { recursive: true });
    }
  }

  async writePid(pid: number): Promise<void> {
    await writeDurably(this.pidPath, `${pid}\n`);
  }

  removePid(): void {
    rmSync(this.pidPath, { force: true });
  }

  readPid(): number | undefined {
    const pid = Number(readIfThere(this.pidPath)?.trim());
    return Number.isSafeInteger(pid) && pid > 0 ? pid : undefined;
  }

  private entries() {
    if (!existsSync(this.root)) return [];
    return readdirSync(this.root, { withFileTypes: true }).map((entry) => {
      const manifest = entry.isDirectory()
        ? readIfThere(join(this.root, entry.name, MANIFEST_FILE))
        : undefined;
      let createdAt: number | undefined;
      if (manifest !== undefined) {
        try {
          createdAt = parseCollectionManifest(manifest, entry.name).created_at;
        } catch {
          // A manifest nothing can read restores nothing: it goes like a partial checkpoint.
        }
      }
      return { name: entry.name, isDirectory: entry.isDirectory(), createdAt };
    });
  }
}
