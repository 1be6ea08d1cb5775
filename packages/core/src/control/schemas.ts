/**
 * Control request bodies: one ajv schema per route, compiled once at import. A body is validated
 * exactly once, by its route; the control plane trusts the typed request it is given. A failure is
 * 422 `invalid_request` whose detail names the field path and the reason.
 */
import { Ajv, type ErrorObject, type ValidateFunction } from 'ajv';

import { InvalidRequestError } from '../errors.js';
import {
  type EpisodeId,
  isCaptureKey,
  isRolloutId,
  MAX_ATTEMPT,
  ROLLOUT_ID_PATTERN,
} from '../identity.js';
import { jsonPointerPath } from '../wire/validate.js';
import { MAX_DEADLINE_AHEAD_SECONDS } from './deadline.js';

export const CHECKPOINT_ID_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._-]*$/;
export const CHECKPOINT_ID_MAX_LENGTH = 128;
/**
 * The most ids one control list names (episodes, rollouts, restarts): a batch's work is bounded
 * by its request, and a million is far above any fleet's rollouts in flight.
 */
export const MAX_CONTROL_LIST_LENGTH = 1_000_000;

export interface CheckpointRequest {
  checkpoint_id: string;
  /** Absolute deadline, wall-clock seconds since the Unix epoch. */
  deadline_ts: number;
}

export interface PrepareRequest extends CheckpointRequest {
  /** Capture keys earlier prepare stages reported as restarts. */
  restarts?: string[];
}

export interface RetireRequest extends CheckpointRequest {
  episode_ids: EpisodeId[];
}

export interface ForgetRequest extends CheckpointRequest {
  rollout_ids: string[];
}

export interface CommitRequest extends CheckpointRequest {
  checkpoint_dir: string;
  /** The episodes the controller continues; null exports everything. */
  episode_ids: EpisodeId[] | null;
  /** Free what the exported state holds outside the process once the write is durable. */
  stop: boolean;
}

export interface RestoreRequest extends CheckpointRequest {
  checkpoint_dir: string;
  /** The checkpointed attempts to continue; each is installed under its next attempt. */
  episode_ids: EpisodeId[];
}

export interface ControlRequests {
  prepare: PrepareRequest;
  renew: CheckpointRequest;
  retire: RetireRequest;
  forget: ForgetRequest;
  commit: CommitRequest;
  restore: RestoreRequest;
  resume: CheckpointRequest;
}

export type ControlRoute = keyof ControlRequests;

const ROLLOUT_ID_REASON = `must match ${ROLLOUT_ID_PATTERN.source} and not end with the reserved attempt suffix -a<N>`;
const CAPTURE_KEY_REASON = 'must be a capture key (<rollout id> or <rollout id>-a<N>)';
const FORMAT_REASONS: Record<string, string> = {
  'rollout-id': ROLLOUT_ID_REASON,
  'capture-key': CAPTURE_KEY_REASON,
  path: 'must not contain a NUL byte',
};

const ajv = new Ajv({ allErrors: false, useDefaults: true, strict: true, allowUnionTypes: true });
ajv.addFormat('rollout-id', { type: 'string', validate: isRolloutId });
ajv.addFormat('capture-key', { type: 'string', validate: isCaptureKey });
// No file system takes a NUL in a path: refused here, not as a failed open later.
ajv.addFormat('path', { type: 'string', validate: (value: string) => !value.includes('\0') });
// Checked against the wall clock when the request arrives, as `deadline_ts` is wall-clock seconds.
ajv.addKeyword({
  keyword: 'maxSecondsAhead',
  type: 'number',
  schemaType: 'number',
  validate: (seconds: number, value: number) => value <= Date.now() / 1000 + seconds,
});

/** An episode id up to attempt `maxAttempt`. */
function episodeIdSchema(maxAttempt: number) {
  return {
    type: 'object',
    additionalProperties: false,
    required: ['rollout_id'],
    properties: {
      rollout_id: { type: 'string', format: 'rollout-id' },
      attempt: { type: 'integer', minimum: 0, maximum: maxAttempt, default: 0 },
    },
  } as const;
}

const base = {
  checkpoint_id: {
    type: 'string',
    minLength: 1,
    maxLength: CHECKPOINT_ID_MAX_LENGTH,
    pattern: CHECKPOINT_ID_PATTERN.source,
  },
  // ajv's `number` already refuses NaN and ±Infinity.
  deadline_ts: { type: 'number', maxSecondsAhead: MAX_DEADLINE_AHEAD_SECONDS },
} as const;

function bodySchema(extra: Record<string, object>, required: string[]) {
  return {
    type: 'object',
    additionalProperties: false,
    required: ['checkpoint_id', 'deadline_ts', ...required],
    properties: { ...base, ...extra },
  };
}

const checkpointDir = { type: 'string', minLength: 1, format: 'path' } as const;
/** A control list, at most MAX_CONTROL_LIST_LENGTH items. */
function list(items: object) {
  return { type: 'array', maxItems: MAX_CONTROL_LIST_LENGTH, items } as const;
}

const episodeIds = list(episodeIdSchema(MAX_ATTEMPT));

const SCHEMAS: Record<ControlRoute, object> = {
  prepare: bodySchema({ restarts: list({ type: 'string', format: 'capture-key' }) }, []),
  renew: bodySchema({}, []),
  resume: bodySchema({}, []),
  retire: bodySchema({ episode_ids: { ...episodeIds, minItems: 1 } }, ['episode_ids']),
  forget: bodySchema({ rollout_ids: { ...list({ type: 'string' }), minItems: 1 } }, [
    'rollout_ids',
  ]),
  commit: bodySchema(
    {
      checkpoint_dir: checkpointDir,
      episode_ids: { ...episodeIds, type: ['array', 'null'], default: null },
      stop: { type: 'boolean', default: false },
    },
    ['checkpoint_dir'],
  ),
  // A restored episode continues as its next attempt, which must be a valid attempt too.
  restore: bodySchema(
    { checkpoint_dir: checkpointDir, episode_ids: list(episodeIdSchema(MAX_ATTEMPT - 1)) },
    ['checkpoint_dir', 'episode_ids'],
  ),
};

const COMPILED = Object.fromEntries(
  Object.entries(SCHEMAS).map(([route, schema]) => [route, ajv.compile(schema)]),
) as Record<ControlRoute, ValidateFunction>;

/** `/episode_ids/0/rollout_id` → `episode_ids[0].rollout_id`. */
function fieldPath(pointer: string, child?: string): string {
  return jsonPointerPath(pointer, child) || '(body)';
}

function describe(err: ErrorObject): string {
  const params = err.params as Record<string, unknown>;
  switch (err.keyword) {
    case 'required':
      return `${fieldPath(err.instancePath, String(params.missingProperty))}: is required`;
    case 'additionalProperties':
      return `${fieldPath(err.instancePath, String(params.additionalProperty))}: is not a known field`;
    case 'maxSecondsAhead':
      return `${fieldPath(err.instancePath)}: must be at most ${MAX_DEADLINE_AHEAD_SECONDS} s from now`;
    case 'format':
      return `${fieldPath(err.instancePath)}: ${FORMAT_REASONS[String(params.format)]}`;
    default:
      return `${fieldPath(err.instancePath)}: ${err.message ?? 'is invalid'}`;
  }
}

function validator<K extends ControlRoute>(route: K): (body: unknown) => ControlRequests[K] {
  const validate = COMPILED[route];
  return (body) => {
    if (typeof body !== 'object' || body === null || Array.isArray(body)) {
      throw new InvalidRequestError(`${route} request body must be a JSON object`);
    }
    if (!validate(body)) {
      const first = validate.errors?.[0];
      throw new InvalidRequestError(
        `invalid ${route} request: ${first ? describe(first) : 'does not match its schema'}`,
      );
    }
    // Validation filled in the defaults (episode attempt 0, commit scope null, stop false).
    return body as ControlRequests[K];
  };
}

/**
 * The validators, one per route. Routes look them up here at request time (never copy them),
 * so a request is validated by exactly one call.
 */
export const CONTROL_VALIDATORS: { [K in ControlRoute]: (body: unknown) => ControlRequests[K] } = {
  prepare: validator('prepare'),
  renew: validator('renew'),
  retire: validator('retire'),
  forget: validator('forget'),
  commit: validator('commit'),
  restore: validator('restore'),
  resume: validator('resume'),
};

export const CONTROL_ROUTES = Object.keys(CONTROL_VALIDATORS) as ControlRoute[];
