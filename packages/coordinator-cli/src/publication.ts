/**
 * The controller's own record of a checkpoint, published into the checkpoint directory once every
 * participant committed: `<dir>/controller.json`. It holds the commit scope, so `restore --dir`
 * continues exactly the episodes the checkpoint continued without the caller listing them.
 */
import { mkdir, open, readFile, rename } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';

import { type ExpectedCheckpoint } from '@ckpt-gym/core/client';
import {
  CheckpointStateError,
  type EpisodeId,
  parseCaptureKey,
  signed,
  verifyManifestMac,
} from '@ckpt-gym/core/protocol';
import { fsyncDirectory } from '@ckpt-gym/core/server';

import { CliFailure } from './context.js';
import { keysOf } from './scope.js';

export const CONTROLLER_FILE = 'controller.json';
export const CONTROLLER_SCHEMA_VERSION = 1;

export interface ControllerRecord {
  readonly schema_version: typeof CONTROLLER_SCHEMA_VERSION;
  readonly checkpoint_id: string;
  /** Epoch seconds. */
  readonly published_at: number;
  /** The commit scope, sorted capture keys. */
  readonly episode_ids: string[];
  /** Restarts left out of the scope: after a crash, retire them and send them again from their input. */
  readonly restarts: string[];
  /** Record count per participant (server name). */
  readonly record_counts: Record<string, number>;
  /** The capture keys each participant (server name) exported; absent in older records. */
  readonly episodes_by_server?: Record<string, string[]>;
}

export function controllerRecord(parts: {
  checkpointId: string;
  publishedAt: number;
  scope: readonly EpisodeId[];
  restarts: readonly string[];
  recordCounts: Record<string, number>;
  exportedByServer: Record<string, string[]>;
}): ControllerRecord {
  return {
    schema_version: CONTROLLER_SCHEMA_VERSION,
    checkpoint_id: parts.checkpointId,
    published_at: parts.publishedAt,
    episode_ids: keysOf(parts.scope).sort(),
    restarts: [...parts.restarts].sort(),
    record_counts: parts.recordCounts,
    episodes_by_server: parts.exportedByServer,
  };
}

/**
 * Writes the record durably (`writeDurably`).
 * With `checkpoint.signing_key` it carries a `mac`, as the manifests do: a forged scope could
 * otherwise make a restore leave out episodes the checkpoint continues.
 */
export async function publish(
  dir: string,
  record: ControllerRecord,
  signingKey?: Uint8Array,
): Promise<string> {
  const path = join(dir, CONTROLLER_FILE);
  const body = signingKey ? signed(signingKey, { ...record }) : record;
  await writeDurably(path, `${JSON.stringify(body, null, 2)}\n`);
  return path;
}

/**
 * Replaces `path` with `text` atomically and durably: a dot-named temporary beside it, fsynced,
 * renamed into place, the directory fsynced.
 */
export async function writeDurably(path: string, text: string): Promise<void> {
  const dir = dirname(path);
  const temporary = join(dir, `.${basename(path)}.${process.pid}.tmp`);
  await mkdir(dir, { recursive: true });
  const handle = await open(temporary, 'w');
  try {
    await handle.writeFile(text, 'utf8');
    await handle.sync();
  } finally {
    await handle.close();
  }
  await rename(temporary, path);
  await fsyncDirectory(dir);
}

/** A rule `record` breaks, or undefined when it is a valid controller record. */
function controllerRecordRefusal(record: unknown): string | undefined {
  if (typeof record !== 'object' || record === null || Array.isArray(record)) {
    return 'is not a JSON object';
  }
  const r = record as Record<string, unknown>;
  if (r.schema_version !== CONTROLLER_SCHEMA_VERSION) {
    return `has schema_version ${JSON.stringify(r.schema_version ?? null)}, not ${CONTROLLER_SCHEMA_VERSION}`;
  }
  if (typeof r.checkpoint_id !== 'string' || r.checkpoint_id === '')
    return 'names no checkpoint_id';
  if (typeof r.published_at !== 'number' || !Number.isFinite(r.published_at)) {
    return 'has no published_at time';
  }
  for (const field of ['episode_ids', 'restarts'] as const) {
    const keys = r[field];
    if (!Array.isArray(keys) || !keys.every((key) => typeof key === 'string')) {
      return `has no ${field} list of capture keys`;
    }
    for (const key of keys as string[]) {
      try {
        parseCaptureKey(key);
      } catch (err) {
        return `lists the bad capture key ${JSON.stringify(key)} in ${field}: ${(err as Error).message}`;
      }
    }
    if (new Set(keys).size !== keys.length) return `lists an episode twice in ${field}`;
  }
  const restarts = new Set(r.restarts as string[]);
  const both = (r.episode_ids as string[]).find((key) => restarts.has(key));
  if (both !== undefined) return `lists ${JSON.stringify(both)} both as continued and as a restart`;
  const counts = r.record_counts;
  if (
    typeof counts !== 'object' ||
    counts === null ||
    Array.isArray(counts) ||
    !Object.values(counts).every((n) => Number.isSafeInteger(n) && (n as number) >= 0)
  ) {
    return 'has no record_counts of whole numbers per server';
  }
  return episodesByServerRefusal(r.episodes_by_server);
}

/** `episodes_by_server`, when present, lists capture keys per server. */
function episodesByServerRefusal(byServer: unknown): string | undefined {
  if (byServer === undefined) return undefined;
  const lists =
    typeof byServer === 'object' && byServer !== null && !Array.isArray(byServer)
      ? Object.values(byServer)
      : [byServer];
  for (const keys of lists) {
    if (!Array.isArray(keys) || !keys.every((key) => typeof key === 'string')) {
      return 'has episodes_by_server that is not a list of capture keys per server';
    }
  }
  return undefined;
}

/**
 * Parses a published record strictly; a bad one is `invalid_checkpoint_state` naming `path`, and
 * so is, with `checkpoint.signing_key`, a record whose MAC is missing or does not verify.
 */
export function parseControllerRecord(
  text: string,
  path: string,
  signingKey?: Uint8Array,
): ControllerRecord {
  let record: unknown;
  try {
    record = JSON.parse(text);
  } catch (err) {
    throw new CheckpointStateError(`${path} is not JSON: ${(err as Error).message}`);
  }
  const refusal = controllerRecordRefusal(record);
  if (refusal !== undefined) throw new CheckpointStateError(`${path} ${refusal}`);
  if (signingKey) verifyManifestMac(signingKey, record as Record<string, unknown>, path);
  return record as ControllerRecord;
}

/** The published record in `dir`: undefined when there is none, a refusal when it is bad. */
export async function readControllerRecord(
  dir: string,
  signingKey?: Uint8Array,
): Promise<ControllerRecord | undefined> {
  const path = join(dir, CONTROLLER_FILE);
  let text: string;
  try {
    text = await readFile(path, 'utf8');
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return undefined;
    throw new CheckpointStateError(
      `cannot read ${path} (${(err as NodeJS.ErrnoException).code ?? (err as Error).message})`,
    );
  }
  return parseControllerRecord(text, path, signingKey);
}

/** What every manifest must agree with: the record's checkpoint id and record counts. */
export function expectedCheckpoint(dir: string, record: ControllerRecord): ExpectedCheckpoint {
  return {
    source: join(dir, CONTROLLER_FILE),
    checkpointId: record.checkpoint_id,
    recordCounts: record.record_counts,
    heldBy: record.episodes_by_server,
  };
}

/** The scope a restore continues, from a published record; a missing file is a failure. */
export function publishedScope(dir: string, record: ControllerRecord | undefined): EpisodeId[] {
  if (record === undefined) {
    throw new CliFailure(
      `cannot read ${join(dir, CONTROLLER_FILE)} (ENOENT); name the restore scope with --episodes`,
    );
  }
  return record.episode_ids.map(parseCaptureKey);
}
