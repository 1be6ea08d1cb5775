/**
 * The episode contract every environment server speaks: `POST /run` with
 * `{episode_id, task: {task_id: {taskset, task_id}, task_input}}`, and the legacy flat row a
 * rollout collection sends to a legacy `/run` instead (its identity in `_ng_*` fields). The
 * collector builds these values; environment and agent servers read them with the parsers here.
 */
import type { EpisodeId } from '../identity.js';
import type { JsonObject, JsonValue } from '../json.js';
import {
  closedObject,
  compileWire,
  EPISODE_ID_SCHEMA,
  type EpisodeIdJson,
  episodeFromJson,
} from './validate.js';

export interface TaskId {
  readonly taskset: string;
  readonly task_id: string;
}

export interface Task {
  readonly task_id: TaskId;
  readonly task_input: JsonObject;
}

/** `POST /run`. */
export interface EpisodeRequest {
  readonly episode_id: EpisodeId;
  readonly task: Task;
}

/**
 * A legacy `/run` row: task fields and `responses_create_params` side by side, the episode named
 * by `_ng_rollout_id` or by `_ng_task_index` and `_ng_rollout_index` at `_ng_attempt_index`
 * (`episodeFromRunBody` reads them).
 */
export type LegacyRunRow = JsonObject & {
  _ng_rollout_id?: JsonValue;
  _ng_task_index?: JsonValue;
  _ng_rollout_index?: JsonValue;
  _ng_attempt_index?: JsonValue;
  responses_create_params?: JsonValue;
};

const NON_EMPTY = { type: 'string', minLength: 1, reason: 'must be a non-empty string' } as const;
const OBJECT = 'must be an object';

const RUN_SCHEMA = closedObject(
  {
    episode_id: EPISODE_ID_SCHEMA,
    task: closedObject(
      {
        task_id: closedObject(
          { taskset: NON_EMPTY, task_id: NON_EMPTY },
          ['taskset', 'task_id'],
          OBJECT,
        ),
        task_input: { type: 'object', reason: OBJECT },
      },
      ['task_id', 'task_input'],
      OBJECT,
    ),
  },
  ['episode_id', 'task'],
);

/**
 * `POST /aggregate_metrics` (an environment server forwards it to its resources server): an object
 * whose `verify_responses`, when given, lists objects. Other keys are forwarded unchanged.
 */
export type AggregateMetricsRequest = JsonObject & { verify_responses?: JsonObject[] };

const AGGREGATE_SCHEMA = {
  type: 'object',
  reason: 'must be a JSON object',
  properties: {
    verify_responses: {
      type: 'array',
      reason: 'must be a list of objects',
      items: { type: 'object', reason: 'must be a list of objects' },
    },
  },
} as const;

const checkRun = compileWire<{ episode_id: EpisodeIdJson; task: Task }>(RUN_SCHEMA);
const checkRow = compileWire<LegacyRunRow>({
  type: 'object',
  reason: 'must be a JSON object (a flat row)',
});

const checkAggregate = compileWire<AggregateMetricsRequest>(AGGREGATE_SCHEMA);

/** Reads a `/run` body (extra keys refused); a bad body is 422 `invalid_request`. */
export function parseEpisodeRequest(body: unknown): EpisodeRequest {
  const run = checkRun(body);
  const { task_id: id, task_input } = run.task;
  return {
    episode_id: episodeFromJson(run.episode_id),
    task: { task_id: { taskset: id.taskset, task_id: id.task_id }, task_input },
  };
}

/** Reads a legacy `/run` row: any JSON object (its identity is read by `episodeFromRunBody`). */
export function parseLegacyRunRow(body: unknown): LegacyRunRow {
  return checkRow(body);
}

/** Reads an `/aggregate_metrics` body; a bad one is 422 `invalid_request`. */
export function parseAggregateMetricsRequest(body: unknown): AggregateMetricsRequest {
  return checkAggregate(body);
}
