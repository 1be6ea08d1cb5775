/** What the parts of `run` share: a leg (one run of the collector) and what came of it. */
import type { Participants } from '@ckpt-gym/core/client';
import type { EpisodeId } from '@ckpt-gym/core/protocol';

import type { Dispatch, InputTask } from '../collect.js';
import { rolloutIdFor } from '../collection/identity.js';
import type { LogHead } from '../collection/resume.js';

/** The tasks of a run, by rollout id. */
export type RunTasks = ReadonlyMap<string, InputTask>;

/** What one leg sends, and what it owes the servers afterwards. */
export interface Leg {
  readonly head: LogHead;
  readonly dispatches: Dispatch[];
  /** Rollouts this leg retired or restored: forgotten once the run is done with them. */
  readonly forgetLater: string[];
  readonly restoredFrom: string | null;
  readonly participants?: Participants;
}

export interface LegOutcome {
  readonly written: number;
  /** Outcomes that are failures (an episode failure, a failed capture). */
  readonly failed: number;
  /** Rows of the run with an outcome, this leg's and earlier ones'. */
  readonly finished: number;
  /** Sent and never answered. */
  readonly lost: { episode: EpisodeId; reason: string }[];
  readonly captureFailed: { episode: EpisodeId; failures: string[] }[];
  readonly checkpoints: string[];
  /** Set when SIGTERM stopped the leg: its checkpoint, or null when that failed. */
  readonly stoppedAt: string | null | undefined;
}

/** Every task's rollout id in run `runId`: a usage error when one would be invalid. */
export function runTasksOf(runId: string, tasks: readonly InputTask[]): Map<string, InputTask> {
  return new Map(tasks.map((t) => [rolloutIdFor(runId, t.key), t] as const));
}

export function dispatchOf(rolloutId: string, attempt: number, task: InputTask): Dispatch {
  return {
    episode: { rollout_id: rolloutId, attempt },
    task: task.task,
    ...(task.row === undefined ? {} : { row: task.row }),
  };
}
