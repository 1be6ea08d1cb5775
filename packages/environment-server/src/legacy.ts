/**
 * `single_agent_turn_legacy`: `/run` takes a flat row (the shape rollout collection sends to an
 * agent's legacy `/run`) and runs it as a native episode over the same protocol, so it checkpoints
 * the same way. Identity: an explicit `_ng_rollout_id` (an explicit `"<id>-aN"` is attempt N of
 * `<id>`), else `"<_ng_task_index>-<_ng_rollout_index>"` at `_ng_attempt_index`.
 */
import {
  episodeFromRunBody,
  type EpisodeRequest,
  InvalidRequestError,
  type JsonObject,
  type JsonValue,
  parseLegacyRunRow,
  RolloutIdRequiredError,
} from '@ckpt-gym/core/protocol';

import type { EpisodeReply } from './protocol.js';

/** Row keys that describe the row, not the task: never forwarded as task data. */
const NON_TASK_KEYS: ReadonlySet<string> = new Set([
  'responses_create_params',
  'agent_ref',
  'task_source',
  'skills_ref',
]);

/** The first of these row keys present names the task; else the task index does. */
const TASK_ID_KEYS = ['task_id', 'problem_id', 'instance_id'] as const;

function present(value: unknown): value is string | number | bigint {
  return typeof value === 'string'
    ? value.length > 0
    : typeof value === 'number' || typeof value === 'bigint';
}

/** The native episode request a flat row stands for. */
export function episodeRequestFromRow(row: unknown, defaultTaskset: string): EpisodeRequest {
  const flat = parseLegacyRunRow(row);
  const episode = episodeFromRunBody(flat);
  if (episode === undefined) {
    throw new RolloutIdRequiredError(
      'the row names no rollout: give _ng_rollout_id, or _ng_task_index and _ng_rollout_index',
    );
  }
  const taskIdValue = [...TASK_ID_KEYS.map((k) => flat[k]), flat._ng_task_index].find(present);
  if (taskIdValue === undefined) {
    throw new InvalidRequestError(
      'the row names no task: give task_id, problem_id, instance_id or _ng_task_index',
    );
  }
  const taskset = present(flat.task_source) ? String(flat.task_source) : defaultTaskset;
  const taskData: JsonObject = {};
  for (const [key, value] of Object.entries(flat)) {
    if (!NON_TASK_KEYS.has(key) && !key.startsWith('_ng_')) taskData[key] = value;
  }
  const params: JsonValue = flat.responses_create_params ?? {};
  return {
    episode_id: episode,
    task: {
      task_id: { taskset, task_id: String(taskIdValue) },
      task_input: { responses_create_params: params, task_data: taskData },
    },
  };
}

/** A flat row: the verify result on success; a failed episode keeps the native reply. */
export function legacyReply(reply: EpisodeReply): JsonObject | EpisodeReply {
  return reply.result ?? reply;
}
