/**
 * The native resources session contract, `POST /seed_session` and `/close_session` with a
 * `resources_session_id`: the seed and close an environment server sends, and the seed's reply.
 * A body without `resources_session_id` is a legacy body, free-form and read by the server's own
 * handler. The environment server builds these values; the resources server reads them here.
 */
import type { EpisodeId } from '../identity.js';
import type { JsonObject } from '../json.js';
import {
  closedObject,
  compileWire,
  EPISODE_ID_SCHEMA,
  type EpisodeIdJson,
  episodeFromJson,
  SESSION_ID_SCHEMA,
} from './validate.js';

/** A native seed's task identity: exactly these two fields. */
export interface ResourcesTaskId {
  taskset: string;
  task_id: string;
}

/** `POST /seed_session`, native. */
export interface NativeSeedRequest {
  resources_session_id: string;
  episode_id: EpisodeId;
  task_id: ResourcesTaskId;
  task_data: JsonObject;
}

/** `POST /close_session`, native: the episode that seeded the session. */
export interface NativeCloseRequest {
  resources_session_id: string;
  episode_id: EpisodeId;
}

/** How an agent reaches the session's tools over MCP, when the server exposes them so. */
export interface ResourcesTools {
  transport?: string;
  server_name?: string;
  url_path?: string;
  headers?: JsonObject;
}

/** The native seed's reply body (the session cookie comes with it). */
export interface NativeSeedReply {
  resources_session_id: string;
  sandbox_access?: JsonObject | null;
  resources_tools?: ResourcesTools | null;
}

const TASK_ID_REASON = 'must be {"taskset": string, "task_id": string}';
const TASK_FIELD = { type: 'string', reason: TASK_ID_REASON } as const;

/** A native body: its session and episode, and the fields of its route. */
function nativeSchema(properties: Record<string, object>, required: string[]) {
  const session = { resources_session_id: SESSION_ID_SCHEMA, episode_id: EPISODE_ID_SCHEMA };
  return closedObject({ ...session, ...properties }, [...Object.keys(session), ...required]);
}

const SEED_SCHEMA = nativeSchema(
  {
    task_id: closedObject(
      { taskset: TASK_FIELD, task_id: TASK_FIELD },
      ['taskset', 'task_id'],
      TASK_ID_REASON,
    ),
    // null reads as no task data, as an absent field does.
    task_data: { type: ['object', 'null'], reason: 'must be an object' },
  },
  ['task_id'],
);

type SeedJson = {
  resources_session_id: string;
  episode_id: EpisodeIdJson;
  task_id: ResourcesTaskId;
  task_data?: JsonObject | null;
};

const checkSeed = compileWire<SeedJson>(SEED_SCHEMA, 'seed_session');
const checkClose = compileWire<{ resources_session_id: string; episode_id: EpisodeIdJson }>(
  nativeSchema({}, []),
  'close_session',
);

/** A body is native when it names a `resources_session_id`; anything else is a legacy body. */
export function isNativeBody(body: JsonObject): boolean {
  return Object.hasOwn(body, 'resources_session_id');
}

/** Reads a native seed (extra fields refused); 422 `invalid_request` naming the field. */
export function parseNativeSeedRequest(body: unknown): NativeSeedRequest {
  const seed = checkSeed(body);
  return {
    resources_session_id: seed.resources_session_id,
    episode_id: episodeFromJson(seed.episode_id),
    task_id: { taskset: seed.task_id.taskset, task_id: seed.task_id.task_id },
    task_data: seed.task_data ?? {},
  };
}

/** Reads a native close (extra fields refused); 422 `invalid_request` naming the field. */
export function parseNativeCloseRequest(body: unknown): NativeCloseRequest {
  const close = checkClose(body);
  return {
    resources_session_id: close.resources_session_id,
    episode_id: episodeFromJson(close.episode_id),
  };
}
