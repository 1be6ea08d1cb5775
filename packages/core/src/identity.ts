/**
 * Episode identity. An episode attempt is `{rollout_id, attempt}`; its capture key is `r` for
 * attempt 0 and `r-aN` for attempt N ≥ 1. The key travels as the path prefix
 * `/ng-rollout/<capture key>/…` on every data-plane call made for the episode; nothing else
 * carries identity.
 */
import type { NextFunction, Request, Response } from 'express';

import { InvalidRequestError, InvalidRolloutIdError } from './errors.js';

export const ROLLOUT_ID_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._-]*$/;
/** `[1-9]` keeps `x-a0` and `x-a01` ordinary rollout ids, which makes the key mapping one-to-one. */
const RESERVED_ATTEMPT_SUFFIX = /-a([1-9][0-9]*)$/;

export const ROLLOUT_PATH_SEGMENT = 'ng-rollout';

/** NAME_MAX of the usual file systems (ext4, xfs, btrfs, tmpfs, APFS): bytes in one file name. */
const FILE_NAME_MAX_BYTES = 255;
/**
 * What a server adds to a capture key to name a file after it, at most: the policy model's capture
 * ledger's longest suffix, `.tokens.incomplete` (its tests write every file of the longest key).
 */
const KEY_FILE_SUFFIX_MAX_LENGTH = 18;
/** What a capture key adds to its rollout id, at most: `-a` and the 16 digits of 2^53 − 1. */
const ATTEMPT_SUFFIX_MAX_LENGTH = `-a${Number.MAX_SAFE_INTEGER}`.length;
/**
 * The longest rollout id (219): its longest capture key plus the longest file suffix must fit one
 * file name (ids are ASCII, one byte a character), so 255 − 18 − 18. Unbounded, an id past node's
 * 16 kB of request headers failed every call under its `/ng-rollout/` prefix on the way. The seed
 * sets no limit and NeMo Gym none (spec reference/control-plane-and-storage.md §1.1): ours.
 */
export const MAX_ROLLOUT_ID_LENGTH =
  FILE_NAME_MAX_BYTES - KEY_FILE_SUFFIX_MAX_LENGTH - ATTEMPT_SUFFIX_MAX_LENGTH;
/** The longest capture key (237): the longest rollout id at the highest attempt. */
export const MAX_CAPTURE_KEY_LENGTH = MAX_ROLLOUT_ID_LENGTH + ATTEMPT_SUFFIX_MAX_LENGTH;

/**
 * The highest attempt (2^31 − 1): a controller's retry counter never comes near it, and a number
 * a request names never sizes work (an attempt of 2^32 once made a retire build an array of that
 * length). The seed sets no limit: ours. Its key suffix is shorter than the length budget above.
 */
export const MAX_ATTEMPT = 2_147_483_647;

export interface EpisodeId {
  readonly rollout_id: string;
  readonly attempt: number;
}

/** Why `rolloutId` cannot name a rollout, or undefined when it can. */
function rolloutIdProblem(rolloutId: unknown): string | undefined {
  if (typeof rolloutId !== 'string') return 'rollout_id must be a string';
  if (rolloutId.length > MAX_ROLLOUT_ID_LENGTH) {
    return `rollout_id of ${rolloutId.length} characters is longer than ${MAX_ROLLOUT_ID_LENGTH}`;
  }
  if (!ROLLOUT_ID_PATTERN.test(rolloutId)) {
    return `rollout_id ${JSON.stringify(rolloutId)} must match ${ROLLOUT_ID_PATTERN.source}`;
  }
  if (RESERVED_ATTEMPT_SUFFIX.test(rolloutId)) {
    return `rollout_id ${JSON.stringify(rolloutId)} must not end with the reserved attempt suffix '-a<N>'`;
  }
  return undefined;
}

function attemptProblem(attempt: unknown): string | undefined {
  if (typeof attempt !== 'number' || !Number.isSafeInteger(attempt) || attempt < 0) {
    return `attempt must be a non-negative safe integer, got ${JSON.stringify(attempt)}`;
  }
  if (attempt > MAX_ATTEMPT) return `attempt ${attempt} is above ${MAX_ATTEMPT}`;
  return undefined;
}

/** True when `rolloutId` can name a rollout (as `episodeId` accepts it), without building one. */
export function isRolloutId(rolloutId: string): boolean {
  return rolloutIdProblem(rolloutId) === undefined;
}

/** Builds a validated episode id; a bad rollout id or attempt is 400 `invalid_rollout_id`. */
export function episodeId(rolloutId: string, attempt = 0): EpisodeId {
  const problem = rolloutIdProblem(rolloutId) ?? attemptProblem(attempt);
  if (problem) throw new InvalidRolloutIdError(problem);
  return { rollout_id: rolloutId, attempt };
}

/**
 * Reads an episode id from a JSON value (`{"rollout_id", "attempt"?}`, no other keys), as a
 * request body carries it. A bad value is 422 `invalid_request` naming `path`.
 */
export function episodeIdFromJson(value: unknown, path = 'episode_id'): EpisodeId {
  const problem = episodeIdProblem(value);
  if (problem) throw new InvalidRequestError(`${path}: ${problem}`);
  const { rollout_id, attempt = 0 } = value as { rollout_id: string; attempt?: number };
  return { rollout_id, attempt };
}

/** What is wrong with an episode id's JSON form (as `episodeIdFromJson` reads it); undefined if nothing. */
export function episodeIdProblem(value: unknown): string | undefined {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    return 'must be an object with rollout_id and attempt';
  }
  const { rollout_id, attempt = 0, ...extra } = value as Record<string, unknown>;
  const unknownKeys = Object.keys(extra);
  return (
    (unknownKeys.length > 0 ? `unknown keys ${unknownKeys.join(', ')}` : undefined) ??
    rolloutIdProblem(rollout_id) ??
    attemptProblem(attempt)
  );
}

/** The JSON form written to records and control bodies: `rollout_id` first, then `attempt`. */
export function episodeIdToJson(e: EpisodeId): { rollout_id: string; attempt: number } {
  return { rollout_id: e.rollout_id, attempt: e.attempt };
}

export function captureKey(e: EpisodeId): string {
  return e.attempt === 0 ? e.rollout_id : `${e.rollout_id}-a${e.attempt}`;
}

/** Parses a capture key back to its episode; a key that names no valid episode is 400 `invalid_rollout_id`. */
export function parseCaptureKey(key: string): EpisodeId {
  if (key.length > MAX_CAPTURE_KEY_LENGTH) {
    throw new InvalidRolloutIdError(
      `capture key of ${key.length} characters is longer than ${MAX_CAPTURE_KEY_LENGTH}`,
    );
  }
  const match = RESERVED_ATTEMPT_SUFFIX.exec(key);
  if (!match) return episodeId(key, 0);
  const attempt = Number(match[1]);
  if (!(attempt <= MAX_ATTEMPT)) {
    throw new InvalidRolloutIdError(
      `capture key ${JSON.stringify(key)} has an attempt above ${MAX_ATTEMPT}`,
    );
  }
  return episodeId(key.slice(0, match.index), attempt);
}

/** True when `key` is a valid capture key. */
export function isCaptureKey(key: string): boolean {
  try {
    parseCaptureKey(key);
    return true;
  } catch {
    return false;
  }
}

export function nextAttempt(e: EpisodeId): EpisodeId {
  return { rollout_id: e.rollout_id, attempt: e.attempt + 1 };
}

export function sameEpisode(a: EpisodeId, b: EpisodeId): boolean {
  return a.rollout_id === b.rollout_id && a.attempt === b.attempt;
}

/** True when `other` is the same rollout at `e`'s attempt or an earlier one (what a retire of `e` stops). */
export function covers(e: EpisodeId, other: EpisodeId): boolean {
  return e.rollout_id === other.rollout_id && other.attempt <= e.attempt;
}

// --- the /ng-rollout/<capture key> path prefix -----------------------------------------------

/** `/ng-rollout/<key>` for an episode or a capture key. */
export function rolloutPathPrefix(episode: EpisodeId | string): string {
  const key =
    typeof episode === 'string' ? captureKey(parseCaptureKey(episode)) : captureKey(episode);
  return `/${ROLLOUT_PATH_SEGMENT}/${key}`;
}

/** `base` (trailing slashes dropped) + `/ng-rollout/<key>` + `path`. */
export function withRolloutPrefix(baseUrl: string, episode: EpisodeId | string, path = ''): string {
  return `${baseUrl.replace(/\/+$/, '')}${rolloutPathPrefix(episode)}${path}`;
}

export interface RolloutPath {
  readonly captureKey: string;
  readonly episode: EpisodeId;
  /** The path after the prefix, always starting with `/` (query string kept). */
  readonly rest: string;
}

const PREFIX_PATTERN = /^\/ng-rollout\/([^/?#]*)(.*)$/s;

/**
 * Splits a request URL into its rollout prefix and the rest. Undefined when the URL carries no
 * prefix; 400 `invalid_rollout_id` when the prefix segment is not a valid capture key.
 */
export function parseRolloutPath(url: string): RolloutPath | undefined {
  const match = PREFIX_PATTERN.exec(url);
  if (!match) return undefined;
  const key = decodeURIComponentSafe(match[1] ?? '');
  const episode = parseCaptureKey(key);
  let rest = match[2] ?? '';
  if (!rest.startsWith('/')) rest = `/${rest}`;
  return { captureKey: key, episode, rest };
}

function decodeURIComponentSafe(segment: string): string {
  try {
    return decodeURIComponent(segment);
  } catch {
    throw new InvalidRolloutIdError(`rollout path segment ${JSON.stringify(segment)} is not valid`);
  }
}

const requestEpisodes = new WeakMap<Request, EpisodeId>();

/** The episode the request's `/ng-rollout/<key>` prefix named, if any. */
export function requestEpisode(req: Request): EpisodeId | undefined {
  return requestEpisodes.get(req);
}

/**
 * Express middleware: strips the `/ng-rollout/<key>` prefix from the URL so the routes behind it
 * see their plain path, and binds the episode to the request (read it with `requestEpisode`).
 * A malformed key is 400 `invalid_rollout_id` before any route runs.
 */
export function rolloutPrefixMiddleware() {
  return (req: Request, _res: Response, next: NextFunction): void => {
    let parsed: RolloutPath | undefined;
    try {
      parsed = parseRolloutPath(req.url);
    } catch (err) {
      next(err);
      return;
    }
    if (parsed) {
      requestEpisodes.set(req, parsed.episode);
      req.url = parsed.rest;
    }
    next();
  };
}

// --- identity of flat run bodies ---------------------------------------------------------------

/**
 * The episode a flat `/run` body names: an explicit `_ng_rollout_id` (which may itself end in
 * `-aN`, how a controller names a replacement attempt), else `<_ng_task_index>-<_ng_rollout_index>`,
 * at `_ng_attempt_index` (default 0). Undefined when the body names no rollout. An explicit id
 * ending in `-aN` together with an attempt index above 0 would decode to no episode and is refused.
 */
export function episodeFromRunBody(body: unknown): EpisodeId | undefined {
  if (typeof body !== 'object' || body === null) return undefined;
  const row = body as Record<string, unknown>;
  const attemptIndex = row._ng_attempt_index ?? 0;
  if (attemptProblem(attemptIndex)) {
    throw new InvalidRolloutIdError(
      `_ng_attempt_index must be a non-negative integer, got ${JSON.stringify(attemptIndex)}`,
    );
  }
  const attempt = attemptIndex as number;
  const explicit = row._ng_rollout_id;
  if (explicit !== undefined && explicit !== null) {
    if (typeof explicit !== 'string') {
      throw new InvalidRolloutIdError(`_ng_rollout_id must be a string, got ${typeof explicit}`);
    }
    // The key's own rules: its length, then the pattern of the id before any `-aN`.
    const named = parseCaptureKey(explicit);
    if (named.attempt > 0 && attempt > 0) {
      throw new InvalidRolloutIdError(
        `_ng_rollout_id ${JSON.stringify(explicit)} names attempt ${named.attempt} and cannot also take _ng_attempt_index ${attempt}`,
      );
    }
    return named.attempt > 0 ? named : episodeId(named.rollout_id, attempt);
  }
  const task = row._ng_task_index;
  const rollout = row._ng_rollout_index;
  if (task === undefined || task === null || rollout === undefined || rollout === null) {
    return undefined;
  }
  return episodeId(
    `${indexText('_ng_task_index', task)}-${indexText('_ng_rollout_index', rollout)}`,
    attempt,
  );
}

/**
 * A row index as rollout-id text: a string or a number (a bigint is how core's codec reads an
 * integer beyond 2^53). Anything else is 400 `invalid_rollout_id`: stringifying it would turn
 * `true` into an id, and cannot turn `{"toString": null}` into anything.
 */
function indexText(key: string, index: unknown): string {
  if (typeof index === 'string' || typeof index === 'number' || typeof index === 'bigint') {
    return String(index);
  }
  const kind = Array.isArray(index) ? 'array' : typeof index;
  throw new InvalidRolloutIdError(`${key} must be a string or a number, got ${kind}`);
}
