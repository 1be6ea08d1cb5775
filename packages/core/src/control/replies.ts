/** What each control call answers (the bodies of the replies under `/ng-control/v1/checkpoint/`). */
import type { PrepareReport } from '../participant.js';
import type { Manifest } from '../store.js';
import type { LastCheckpoint } from './last-checkpoint.js';
import type { Phase } from './phases.js';

export interface StatusReply {
  kind: string;
  instance: string;
  phase: Phase;
  checkpoint_id: string | null;
  lease_expires_at: number | null;
  retired_rollouts: number;
  report: PrepareReport;
  /** The latest checkpoint's operations with their stage timings; null before the first. */
  last_checkpoint: LastCheckpoint | null;
  [extra: string]: unknown;
}

export interface PrepareReply {
  phase: Phase;
  report: PrepareReport;
}

export interface CommitReply {
  phase: 'committed';
  manifest: Manifest;
  /** Sorted unique capture keys of the exported records. */
  episode_ids: string[];
  [extra: string]: unknown;
}

export interface RestoreReply {
  phase: 'restored';
  source_checkpoint_id: string;
  /** Sorted capture keys of the next attempt of every installed record. */
  restored: string[];
}

export interface ResumeReply {
  phase: 'idle';
  idempotent: boolean;
}
