/**
 * Shared setup for control-plane tests: a plane over a TestParticipant with a fake clock and a
 * silent logger, a temporary checkpoint root, request builders and a promise tracker.
 */
import { existsSync } from 'node:fs';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';

import { ControlPlane, type ControlPlaneOptions } from '../../src/control/plane.js';
import type { CommitRequest, RestoreRequest } from '../../src/control/schemas.js';
import { type EpisodeId, parseCaptureKey } from '../../src/identity.js';
import { MANIFEST_FILE, writeParticipantState } from '../../src/store.js';
import { FakeClock, settle } from '../support/fake-clock.js';
import { MemoryLogger, type TestRecord, TestParticipant } from '../support/test-participant.js';

export { settle };

export interface Harness {
  clock: FakeClock;
  participant: TestParticipant;
  plane: ControlPlane<TestRecord>;
  logger: MemoryLogger;
  /** A deadline `seconds` from the fake now. */
  at(seconds?: number): number;
  /** A checkpoint directory under the test's temporary root. */
  dir(name: string): string;
}

const planes: ControlPlane<TestRecord>[] = [];
let root = '';

/** Call once per test file: a fresh temporary root per test, and every plane disposed after it. */
export function useHarness(): void {
  beforeEach(async () => {
    root = await mkdtemp(join(tmpdir(), 'ckpt-control-'));
  });
  afterEach(async () => {
    for (const plane of planes.splice(0)) plane.dispose();
    await rm(root, { recursive: true, force: true });
  });
}

export function harness(options: Partial<ControlPlaneOptions> = {}): Harness {
  const clock = new FakeClock();
  const participant = new TestParticipant();
  const logger = new MemoryLogger();
  const plane = new ControlPlane(participant, { leaseGraceSeconds: 60, clock, logger, ...options });
  planes.push(plane);
  return {
    clock,
    participant,
    plane,
    logger,
    at: (seconds = 10) => clock.now() + seconds,
    dir: (name) => join(root, name),
  };
}

export function ep(key: string): EpisodeId {
  return parseCaptureKey(key);
}

export function eps(...keys: string[]): EpisodeId[] {
  return keys.map(ep);
}

export function commitRequest(
  h: Harness,
  id: string,
  keys: string[] | null,
  extra: Partial<CommitRequest> = {},
): CommitRequest {
  return {
    checkpoint_id: id,
    deadline_ts: h.at(),
    checkpoint_dir: h.dir(id),
    episode_ids: keys === null ? null : eps(...keys),
    stop: false,
    ...extra,
  };
}

export function restoreRequest(
  h: Harness,
  id: string,
  source: string,
  keys: string[],
): RestoreRequest {
  return {
    checkpoint_id: id,
    deadline_ts: h.at(),
    checkpoint_dir: h.dir(source),
    episode_ids: eps(...keys),
  };
}

export function manifestPath(h: Harness, checkpoint: string): string {
  return join(h.dir(checkpoint), 'gym', h.participant.kind, h.participant.instance, MANIFEST_FILE);
}

/** The records of a committed checkpoint, as JSON. */
export async function readRecords(h: Harness, checkpoint: string): Promise<unknown[]> {
  const manifest = JSON.parse(await readFile(manifestPath(h, checkpoint), 'utf8')) as {
    records_file: string;
  };
  const text = await readFile(
    join(dirname(manifestPath(h, checkpoint)), manifest.records_file),
    'utf8',
  );
  return text
    .split('\n')
    .filter(Boolean)
    .map((line) => JSON.parse(line) as unknown);
}

export function hasManifest(h: Harness, checkpoint: string): boolean {
  return existsSync(manifestPath(h, checkpoint));
}

/** Parks the episodes `keys` (started parked) and prepares `id` until prepared. */
export async function prepared(h: Harness, id: string, keys: string[] = []): Promise<void> {
  for (const key of keys) h.participant.start(key, 'parked');
  const reply = await h.plane.prepare({ checkpoint_id: id, deadline_ts: h.at() });
  expect(reply.phase).toBe('prepared');
}

/** Writes a checkpoint for the harness's participant directly through the store. */
export async function writeCheckpoint(
  h: Harness,
  name: string,
  records: { key: string; payload?: unknown }[],
): Promise<void> {
  await writeParticipantState({
    checkpointDir: h.dir(name),
    kind: h.participant.kind,
    instance: h.participant.instance,
    checkpointId: name,
    records: records.map(({ key, payload }) =>
      payload === undefined ? { episode_id: ep(key) } : { episode_id: ep(key), payload },
    ),
  });
}

export interface Tracked<T> {
  settled: boolean;
  value: T | undefined;
  error: unknown;
  promise: Promise<T>;
}

/** Watches a promise so a test can ask whether it has settled yet. */
export function track<T>(promise: Promise<T>): Tracked<T> {
  const tracked: Tracked<T> = { settled: false, value: undefined, error: undefined, promise };
  promise.then(
    (value) => {
      tracked.settled = true;
      tracked.value = value;
    },
    (error: unknown) => {
      tracked.settled = true;
      tracked.error = error;
    },
  );
  return tracked;
}

/** Settles until `predicate` holds (real I/O may take a few rounds); fails after `rounds`. */
export async function until(predicate: () => boolean, rounds = 500): Promise<void> {
  for (let i = 0; i < rounds; i++) {
    if (predicate()) return;
    await new Promise((resolve) => setTimeout(resolve, 2));
  }
  throw new Error('condition not reached');
}
