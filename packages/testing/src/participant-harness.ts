/**
 * A participant of your own under a real `ControlPlane`, driven in-process on a fake clock: the
 * same plane every server uses, with its deadlines and leases, but time moves only when the test
 * advances it. The checkpoint directories live under a temporary root that `await using` removes.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import {
  type CheckpointRecord,
  type CommitReply,
  ControlPlane,
  type ControlPlaneOptions,
  type Participant,
  type PrepareReply,
  type RestoreReply,
  type ResumeReply,
} from '@ckpt-gym/core/server';
import { FakeClock, MemoryLogger } from '@ckpt-gym/core/testing';

import { episodes } from './episodes.js';

export interface ParticipantHarness<R extends CheckpointRecord> extends AsyncDisposable {
  readonly participant: Participant<R>;
  readonly plane: ControlPlane<R>;
  readonly clock: FakeClock;
  readonly logger: MemoryLogger;
  /** The temporary root holding every checkpoint directory of this harness. */
  readonly root: string;
  /** A deadline `seconds` from the fake now. */
  at(seconds?: number): number;
  /** The directory of checkpoint `id` under the root. */
  dir(id: string): string;
  prepare(id: string, restarts?: string[]): Promise<PrepareReply>;
  /** Commits checkpoint `id` with the episodes of capture keys `keys` (null: every one). */
  commit(id: string, keys: string[] | null): Promise<CommitReply>;
  /** Restores the episodes `keys` of checkpoint `from` as checkpoint `id`. */
  restore(id: string, from: string, keys: string[]): Promise<RestoreReply>;
  resume(id: string): Promise<ResumeReply>;
}

export interface HarnessOptions extends Partial<ControlPlaneOptions> {
  /**
   * The checkpoint root of an earlier harness: a restore in a fresh participant reads what the
   * first one committed. The harness that created the root removes it.
   */
  root?: string;
}

export async function participantHarness<R extends CheckpointRecord>(
  participant: Participant<R>,
  options: HarnessOptions = {},
): Promise<ParticipantHarness<R>> {
  const { root: sharedRoot, ...planeOptions } = options;
  const root = sharedRoot ?? (await mkdtemp(join(tmpdir(), 'ckpt-gym-harness-')));
  const clock = new FakeClock();
  const logger = new MemoryLogger();
  const plane = new ControlPlane(participant, {
    leaseGraceSeconds: 60,
    clock,
    logger,
    ...planeOptions,
  });
  const at = (seconds = 10) => clock.now() + seconds;
  const dir = (id: string) => join(root, id);
  return {
    participant,
    plane,
    clock,
    logger,
    root,
    at,
    dir,
    prepare: (id, restarts) =>
      plane.prepare({ checkpoint_id: id, deadline_ts: at(), ...(restarts ? { restarts } : {}) }),
    commit: (id, keys) =>
      plane.commit({
        checkpoint_id: id,
        deadline_ts: at(),
        checkpoint_dir: dir(id),
        episode_ids: keys === null ? null : episodes(...keys),
        stop: false,
      }),
    restore: (id, from, keys) =>
      plane.restore({
        checkpoint_id: id,
        deadline_ts: at(),
        checkpoint_dir: dir(from),
        episode_ids: episodes(...keys),
      }),
    resume: (id) => plane.resume({ checkpoint_id: id, deadline_ts: at() }),
    async [Symbol.asyncDispose]() {
      plane.dispose();
      if (sharedRoot === undefined) await rm(root, { recursive: true, force: true });
    },
  };
}
