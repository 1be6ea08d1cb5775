/**
 * NeMo Gym rows in and out, as `ng_collect_rollouts` reads and writes them. Pure.
 *
 * In: one row a line with `responses_create_params`, an optional `agent_ref` and the verifier's
 * fields at top level. `--limit N` takes the first N rows; each row is stamped with
 * `_ng_task_index` (kept when given, else one per distinct row text) and, repeated
 * `--num-repeats` times, `_ng_rollout_index` 0, 1, … within its task.
 *
 * Out: the flat `/run` reply (`reward`, `response`, the verifier's fields) with the indices, the
 * row's `agent_ref`, `_ng_rollout_id` and `_ng_attempt_index` (from attempt 1); a failed episode
 * goes to the `<stem>_failures.jsonl` sidecar instead, tagged `_ng_failure_class`.
 */
import { join, parse } from 'node:path';

import { episodeRequestFromRow } from '@ckpt-gym/environment-server';

import type { TaskSpec } from '../collect.js';

export type JsonRow = Record<string, unknown>;

export const TASK_INDEX_KEY = '_ng_task_index';
export const ROLLOUT_INDEX_KEY = '_ng_rollout_index';
export const ROLLOUT_ID_KEY = '_ng_rollout_id';
export const ATTEMPT_INDEX_KEY = '_ng_attempt_index';
/** The run a row belongs to: ours, beside NeMo Gym's other `_ng_` identity keys. */
export const RUN_ID_KEY = '_ng_run_id';
export const FAILURE_CLASS_KEY = '_ng_failure_class';
/** The failure class of an episode the environment server failed (NeMo Gym's name for it). */
export const ENVIRONMENT_FAILED = 'environment_server_failed';
/** The failure class of a reply whose token capture failed: its tokens cannot train. */
export const CAPTURE_FAILED = 'capture_failed';
const DEFAULT_TASKSET = 'nemo_gym';

/** One NeMo Gym row to collect, stamped with its indices; `key` names it within the run. */
export interface NemoTask {
  readonly key: string;
  readonly row: JsonRow;
}

export interface NemoOptions {
  readonly limit?: number;
  readonly numRepeats?: number;
}

/** Whether a parsed input row is a NeMo Gym row (its create params at top level, no task_input). */
export function isNemoRow(row: JsonRow): boolean {
  return typeof row.responses_create_params === 'object' && row.task_input === undefined;
}

export function nemoTasks(rows: readonly JsonRow[], options: NemoOptions = {}): NemoTask[] {
  const taken = options.limit === undefined ? rows : rows.slice(0, options.limit);
  const byText = new Map<string, number>();
  const nextRollout = new Map<string, number>();
  const tasks: NemoTask[] = [];
  taken.forEach((row, i) => {
    if (typeof row.responses_create_params !== 'object' || row.responses_create_params === null) {
      throw new Error(`row ${i + 1}: responses_create_params must be an object`);
    }
    const text = JSON.stringify(row);
    const given = row[TASK_INDEX_KEY];
    const taskIndex = given ?? byText.get(text) ?? byText.size;
    if (given === undefined && !byText.has(text)) byText.set(text, taskIndex as number);
    for (let repeat = 0; repeat < (options.numRepeats ?? 1); repeat += 1) {
      const rolloutIndex = nextRollout.get(String(taskIndex)) ?? 0;
      nextRollout.set(String(taskIndex), rolloutIndex + 1);
      tasks.push({
        key: `${String(taskIndex)}-${rolloutIndex}`,
        row: { ...row, [TASK_INDEX_KEY]: taskIndex, [ROLLOUT_INDEX_KEY]: rolloutIndex },
      });
    }
  });
  return tasks;
}

/** The native task a NeMo Gym row stands for: the legacy environment's own conversion. */
export function nemoNativeTask(row: JsonRow): TaskSpec {
  const agent = (row.agent_ref as { name?: unknown } | undefined)?.name;
  const taskset = typeof agent === 'string' && agent !== '' ? agent : DEFAULT_TASKSET;
  return episodeRequestFromRow(row, taskset).task as TaskSpec;
}

/** A native task as a flat row, for `single_agent_turn_legacy`. */
export function flatRowFromTask(task: TaskSpec): JsonRow {
  const input = task.task_input as { responses_create_params?: unknown; task_data?: JsonRow };
  return {
    ...(input.task_data ?? {}),
    responses_create_params: input.responses_create_params ?? {},
    task_id: task.task_id.task_id,
    task_source: task.task_id.taskset,
  };
}

/** The flat `/run` body of a row's attempt: the row with its explicit rollout id and attempt. */
export function flatRunBody(row: JsonRow, rolloutId: string, attempt: number): JsonRow {
  return { ...row, [ROLLOUT_ID_KEY]: rolloutId, [ATTEMPT_INDEX_KEY]: attempt };
}

export interface Outcome {
  readonly result: JsonRow | null;
  readonly failure: JsonRow | null;
  /** Lineage rows of the attempt whose token capture failed, with their reasons. */
  readonly captureFailures: readonly string[];
}

/** A NeMo Gym output row, and whether it belongs in the failures sidecar. */
export function nemoOutputRow(
  task: NemoTask,
  ids: { runId: string; rolloutId: string; attempt: number },
  outcome: Outcome,
): { failed: boolean; row: JsonRow } {
  const identity: JsonRow = {
    [TASK_INDEX_KEY]: task.row[TASK_INDEX_KEY],
    [ROLLOUT_INDEX_KEY]: task.row[ROLLOUT_INDEX_KEY],
    ...(task.row.agent_ref === undefined ? {} : { agent_ref: task.row.agent_ref }),
    [ROLLOUT_ID_KEY]: ids.rolloutId,
    ...(ids.attempt > 0 ? { [ATTEMPT_INDEX_KEY]: ids.attempt } : {}),
    [RUN_ID_KEY]: ids.runId,
  };
  const failureClass = failureClassOf(outcome);
  if (failureClass === undefined) return { failed: false, row: { ...outcome.result, ...identity } };
  const failure = outcome.failure ?? {};
  return {
    failed: true,
    row: {
      ...(outcome.result ?? {}),
      ...identity,
      [FAILURE_CLASS_KEY]: failureClass,
      ...(failure.stage === undefined ? {} : { _ng_failure_stage: failure.stage }),
      ...(failure.failure_reason === undefined
        ? {}
        : { _ng_failure_reason: failure.failure_reason }),
      ...(failure.terminal === true ? { _ng_failure_terminal: true } : {}),
      ...(outcome.captureFailures.length > 0
        ? { _ng_capture_failures: outcome.captureFailures }
        : {}),
    },
  };
}

function failureClassOf(outcome: Outcome): string | undefined {
  const stamped = outcome.result?.[FAILURE_CLASS_KEY];
  if (typeof stamped === 'string') return stamped;
  if (outcome.failure !== null || outcome.result === null) return ENVIRONMENT_FAILED;
  if (outcome.captureFailures.length > 0) return CAPTURE_FAILED;
  return undefined;
}

/** `<dir>/<stem>_failures.jsonl` beside `<dir>/<stem>.<ext>`, as NeMo Gym names it. */
export function failuresPathFor(output: string): string {
  const { dir, name } = parse(output);
  return join(dir, `${name}_failures.jsonl`);
}
