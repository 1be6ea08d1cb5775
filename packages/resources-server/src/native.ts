/**
 * Native (environment-server) session bodies and the book that makes them idempotent: the same
 * `resources_session_id` seeded again by the same episode with the same task is the same session;
 * a closed id cannot be seeded again; a close names the episode that seeded it.
 */
import {
  captureKey,
  encodeJson,
  type EpisodeId,
  episodeIdFromJson,
  InvalidRequestError,
  type JsonObject,
  sameEpisode,
  StaleAttemptError,
} from '@ckpt-gym/core';

import type { NativeSeed } from './definition.js';

export interface NativeClose {
  readonly resourcesSessionId: string;
  readonly episode: EpisodeId;
}

function isObject(value: unknown): value is JsonObject {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function onlyKeys(body: JsonObject, allowed: readonly string[], what: string): void {
  const extra = Object.keys(body).filter((k) => !allowed.includes(k));
  if (extra.length > 0) throw new InvalidRequestError(`${what}: unknown keys ${extra.join(', ')}`);
}

/**
 * The longest `resources_session_id`: its signed cookie must fit in a reply header a client can
 * read (node refuses headers over 16 kB in all; browsers a cookie over 4 kB).
 */
export const MAX_RESOURCES_SESSION_ID_CHARS = 256;
/** With the `u` flag a lone surrogate is a code point of its own (category Cs); a pair is not. */
const LONE_SURROGATE = /\p{Cs}/u;

/**
 * A non-empty id of well-formed Unicode (a lone surrogate has no UTF-8 form: the cookie would name
 * another id) of at most MAX_RESOURCES_SESSION_ID_CHARS; 422 otherwise.
 */
function sessionIdOf(body: JsonObject, what: string): string {
  const id = body.resources_session_id;
  if (
    typeof id !== 'string' ||
    id === '' ||
    id.length > MAX_RESOURCES_SESSION_ID_CHARS ||
    LONE_SURROGATE.test(id)
  ) {
    throw new InvalidRequestError(
      `${what}.resources_session_id: must be a non-empty string of at most ${MAX_RESOURCES_SESSION_ID_CHARS} characters, without lone surrogates`,
    );
  }
  return id;
}

/** A body is native when it names a `resources_session_id`; anything else is a legacy body. */
export function isNativeBody(body: JsonObject): boolean {
  return Object.hasOwn(body, 'resources_session_id');
}

export function parseNativeSeed(body: JsonObject): NativeSeed {
  const what = 'seed_session';
  onlyKeys(body, ['resources_session_id', 'episode_id', 'task_id', 'task_data'], what);
  const taskId = body.task_id;
  if (
    !isObject(taskId) ||
    typeof taskId.taskset !== 'string' ||
    typeof taskId.task_id !== 'string' ||
    Object.keys(taskId).length !== 2
  ) {
    throw new InvalidRequestError(
      `${what}.task_id: must be {"taskset": string, "task_id": string}`,
    );
  }
  const taskData = body.task_data ?? {};
  if (!isObject(taskData)) throw new InvalidRequestError(`${what}.task_data: must be an object`);
  return {
    resourcesSessionId: sessionIdOf(body, what),
    episode: episodeIdFromJson(body.episode_id, `${what}.episode_id`),
    taskId: { taskset: taskId.taskset, task_id: taskId.task_id },
    taskData,
  };
}

export function parseNativeClose(body: JsonObject): NativeClose {
  const what = 'close_session';
  onlyKeys(body, ['resources_session_id', 'episode_id'], what);
  return {
    resourcesSessionId: sessionIdOf(body, what),
    episode: episodeIdFromJson(body.episode_id, `${what}.episode_id`),
  };
}

/** A native body's episode must be the one its rollout prefix names. */
export function checkPrefixMatches(body: EpisodeId, prefix: EpisodeId | undefined): void {
  if (prefix !== undefined && !sameEpisode(body, prefix)) {
    throw new InvalidRequestError(
      `episode_id ${captureKey(body)} does not match the rollout prefix ${captureKey(prefix)}`,
    );
  }
}

interface Seeded {
  readonly episode: EpisodeId;
  /** The task id and data as encoded once, compared on a repeated seed. */
  readonly task: string;
  readonly taskData: JsonObject;
}

export class NativeSessions {
  readonly #open = new Map<string, Seeded>();
  readonly #closed = new Set<string>();

  /** True when the seed is new; false when it repeats an identical one. Refuses a conflicting seed. */
  seed(seed: NativeSeed): boolean {
    const id = seed.resourcesSessionId;
    if (this.#closed.has(id)) {
      throw new InvalidRequestError(
        `resources session '${id}' is closed and cannot be seeded again`,
      );
    }
    const task = encodeJson([seed.taskId, seed.taskData]);
    const earlier = this.#open.get(id);
    if (earlier) {
      if (!sameEpisode(earlier.episode, seed.episode) || earlier.task !== task) {
        throw new InvalidRequestError(
          `resources session '${id}' was seeded with different task data or identity`,
        );
      }
      return false;
    }
    this.#open.set(id, { episode: seed.episode, task, taskData: seed.taskData });
    return true;
  }

  /** Marks the id closed (never seeded again); refuses a close by another episode. */
  close(id: string, episode: EpisodeId | undefined): void {
    const earlier = this.#open.get(id);
    if (earlier && episode && !sameEpisode(earlier.episode, episode)) {
      throw new StaleAttemptError(
        `resources session '${id}' belongs to episode ${captureKey(earlier.episode)}, not ${captureKey(episode)}`,
      );
    }
    this.#open.delete(id);
    this.#closed.add(id);
  }

  taskData(sessionId: string): JsonObject | undefined {
    return this.#open.get(sessionId)?.taskData;
  }

  /** Forgets a session a retire freed; a later seed of its id starts it afresh. */
  forget(sessionId: string): void {
    this.#open.delete(sessionId);
  }
}
