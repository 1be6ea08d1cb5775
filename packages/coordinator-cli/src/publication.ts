/**
 * The controller's own record of a checkpoint, published into the checkpoint directory once every
 * participant committed: `<dir>/controller.json`. It holds the commit scope, so `restore --dir`
 * continues exactly the episodes the checkpoint continued without the caller listing them.
 */
import { mkdir, open, readFile, rename } from 'node:fs/promises';
import { join } from 'node:path';

import {
  CheckpointStateError,
  type EpisodeId,
  fsyncDirectory,
  parseCaptureKey,
  signed,
  verifyManifestMac,
} from '@ckpt-gym/core';

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
}

export function controllerRecord(parts: {
  checkpointId: string;
  publishedAt: number;
  scope: readonly EpisodeId[];
  restarts: readonly string[];
  recordCounts: Record<string, number>;
}): ControllerRecord {
  return {
    schema_version: CONTROLLER_SCHEMA_VERSION,
    checkpoint_id: parts.checkpointId,
    published_at: parts.publishedAt,
    episode_ids: keysOf(parts.scope).sort(),
    restarts: [...parts.restarts].sort(),
    record_counts: parts.recordCounts,
  };
}

/**
 * Writes the record durably: a temporary file, fsynced, renamed into place, directory fsynced.
 * With `checkpoint.signing_key` it carries a `mac`, as the manifests do: a forged scope could
 * otherwise make a restore leave out episodes the checkpoint continues.
 */
export async function publish(
  dir: string,
  record: ControllerRecord,
  signingKey?: Uint8Array,
): Promise<string> {
  const path = join(dir, CONTROLLER_FILE);
  const temporary = `${path}.${process.pid}.tmp`;
  await mkdir(dir, { recursive: true });
  const handle = await open(temporary, 'w');
  try {
    const body = signingKey ? signed(signingKey, { ...record }) : record;
    await handle.writeFile(`${JSON.stringify(body, null, 2)}\n`, 'utf8');
    await handle.sync();
  } finally {
    await handle.close();
  }
  await rename(temporary, path);
  await fsyncDirectory(dir);
  return path;
}

/**
 * The scope a restore continues, from a published record; a missing or bad file is a failure, and
 * so is, with `checkpoint.signing_key`, a record whose MAC is missing or does not verify.
 */
export async function publishedScope(dir: string, signingKey?: Uint8Array): Promise<EpisodeId[]> {
  const path = join(dir, CONTROLLER_FILE);
  let text: string;
  try {
    text = await readFile(path, 'utf8');
  } catch (err) {
    throw new CliFailure(
      `cannot read ${path} (${(err as NodeJS.ErrnoException).code ?? (err as Error).message}); ` +
        'name the restore scope with --episodes',
    );
  }
  try {
    const record = JSON.parse(text) as Partial<ControllerRecord> | null;
    if (
      record?.schema_version !== CONTROLLER_SCHEMA_VERSION ||
      !Array.isArray(record.episode_ids)
    ) {
      throw new Error(`not a schema_version ${CONTROLLER_SCHEMA_VERSION} record with episode_ids`);
    }
    if (signingKey) verifyManifestMac(signingKey, record, path);
    return record.episode_ids.map((key) => parseCaptureKey(String(key)));
  } catch (err) {
    if (err instanceof CheckpointStateError) throw err; // a forgery: --episodes is no remedy
    throw new CliFailure(
      `${path}: ${(err as Error).message}; name the restore scope with --episodes`,
    );
  }
}
