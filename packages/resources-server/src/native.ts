/**
 * Native (environment-server) session bodies and the book that makes them idempotent: the same
 * `resources_session_id` seeded again by the same episode with the same task is the same session;
 * a closed id cannot be seeded again; a close names the episode that seeded it. The bodies' shapes
 * are core's wire contract (`parseNativeSeedRequest`, `parseNativeCloseRequest`).
 */
import {
  captureKey,
  encodeJson,
  type EpisodeId,
  InvalidRequestError,
  type JsonObject,
  parseNativeCloseRequest,
  parseNativeSeedRequest,
  sameEpisode,
  StaleAttemptError,
} from '@ckpt-gym/core/protocol';

import type { NativeSeed } from './definition.js';

export interface NativeClose {
  readonly resourcesSessionId: string;
  readonly episode: EpisodeId;
}

/** A native seed as the resources server's handlers see it. */
export function parseNativeSeed(body: JsonObject): NativeSeed {
  const seed = parseNativeSeedRequest(body);
  return {
    resourcesSessionId: seed.resources_session_id,
    episode: seed.episode_id,
    taskId: seed.task_id,
    taskData: seed.task_data,
  };
}

export function parseNativeClose(body: JsonObject): NativeClose {
  const close = parseNativeCloseRequest(body);
  return { resourcesSessionId: close.resources_session_id, episode: close.episode_id };
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
