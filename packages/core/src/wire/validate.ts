/**
 * The validator every inter-server wire contract shares: one ajv instance, each contract's schema
 * compiled once at import, and one refusal: 422 `invalid_request` whose detail names the field
 * (`tool_accesses[1].name: …`) and says what it must be. A schema may carry a `reason`, what the
 * refusal says about its field; without one, ajv's own message is used.
 */
import { Ajv, type ErrorObject, type SchemaValidateFunction } from 'ajv';

import { InvalidRequestError } from '../errors.js';
import { type EpisodeId, episodeIdProblem } from '../identity.js';

/**
 * The longest session id (agent or resources): its signed cookie must fit in a reply header a
 * client can read (node refuses headers over 16 kB in all; browsers a cookie over 4 kB).
 */
export const MAX_SESSION_ID_CHARS = 256;
/** With the `u` flag a lone surrogate is a code point of its own (category Cs); a pair is not. */
const LONE_SURROGATE = /\p{Cs}/u;

/**
 * A session id is non-empty, at most MAX_SESSION_ID_CHARS UTF-16 units, and well-formed Unicode:
 * a lone surrogate has no UTF-8 form, so the cookie would name another id.
 */
export function isSessionId(value: string): boolean {
  return value.length > 0 && value.length <= MAX_SESSION_ID_CHARS && !LONE_SURROGATE.test(value);
}

export const SESSION_ID_REASON = `must be a non-empty string of at most ${MAX_SESSION_ID_CHARS} characters, without lone surrogates`;

/** An episode id as a body carries it: `attempt` defaults to 0. */
export interface EpisodeIdJson {
  readonly rollout_id: string;
  readonly attempt?: number;
}

/** The episode id a validated `EpisodeIdJson` names, with its attempt filled in. */
export function episodeFromJson(value: EpisodeIdJson): EpisodeId {
  return { rollout_id: value.rollout_id, attempt: value.attempt ?? 0 };
}

// Identity's own rule and messages, so an episode id is refused alike in every body.
const checkEpisodeId: SchemaValidateFunction = (_schema: boolean, data: unknown) => {
  const problem = episodeIdProblem(data);
  checkEpisodeId.errors =
    problem === undefined ? [] : [{ keyword: 'episodeId', message: problem, params: {} }];
  return problem === undefined;
};

const ajv = new Ajv({ allErrors: false, strict: true, allowUnionTypes: true, verbose: true });
// An annotation, never a check: what a refusal says about the field.
ajv.addKeyword({ keyword: 'reason', schemaType: 'string' });
ajv.addKeyword({
  keyword: 'episodeId',
  schemaType: 'boolean',
  errors: true,
  validate: checkEpisodeId,
});
ajv.addFormat('session-id', { type: 'string', validate: isSessionId });
ajv.addFormat('http-url', {
  type: 'string',
  validate: (value: string) => /^https?:\/\//.test(value) && URL.canParse(value),
});

/** The schema of a session id field (agent or resources). */
export const SESSION_ID_SCHEMA = {
  type: 'string',
  format: 'session-id',
  reason: SESSION_ID_REASON,
} as const;

/** An object of these fields only, the `required` ones present; `reason`: what anything else is told. */
export function closedObject(
  properties: Record<string, object>,
  required: readonly string[],
  reason = 'must be a JSON object',
) {
  return { type: 'object', reason, additionalProperties: false, required, properties } as const;
}

/** The schema of an episode id field. */
export const EPISODE_ID_SCHEMA = {
  episodeId: true,
  // What a missing episode id is told, as identity.ts tells one that is no object.
  reason: 'must be an object with rollout_id and attempt',
} as const;

/** `/episode_ids/0/rollout_id` → `episode_ids[0].rollout_id` (then `child`); '' for the root. */
export function jsonPointerPath(pointer: string, child?: string): string {
  const parts = pointer
    .split('/')
    .slice(1)
    .map((p) => p.replace(/~1/g, '/').replace(/~0/g, '~'));
  if (child !== undefined) parts.push(child);
  let path = '';
  for (const part of parts) path += /^\d+$/.test(part) ? `[${part}]` : path ? `.${part}` : part;
  return path;
}

/** The field at `pointer` under `prefix` (`seed_session.task_id`); the body itself is `body`. */
function fieldPath(prefix: string, pointer: string, child?: string): string {
  const path = jsonPointerPath(pointer, child);
  if (!prefix || !path) return prefix || path || 'body';
  return path.startsWith('[') ? `${prefix}${path}` : `${prefix}.${path}`;
}

interface Annotated {
  reason?: string;
  properties?: Record<string, Annotated>;
}

function describe(err: ErrorObject, prefix: string): string {
  const schema = (err.parentSchema ?? {}) as Annotated;
  const params = err.params as Record<string, unknown>;
  switch (err.keyword) {
    case 'required': {
      const missing = String(params.missingProperty);
      const reason = schema.properties?.[missing]?.reason ?? 'is required';
      return `${fieldPath(prefix, err.instancePath, missing)}: ${reason}`;
    }
    case 'additionalProperties': {
      const known = schema.properties ?? {};
      const extra = Object.keys(err.data as object).filter((k) => !Object.hasOwn(known, k));
      return `${fieldPath(prefix, err.instancePath)}: unknown keys ${extra.join(', ')}`;
    }
    case 'episodeId':
      return `${fieldPath(prefix, err.instancePath)}: ${err.message}`;
    default:
      return `${fieldPath(prefix, err.instancePath)}: ${schema.reason ?? err.message ?? 'is invalid'}`;
  }
}

/**
 * Compiles a contract's schema once; the validator returns the body as its wire type or throws
 * 422 `invalid_request` naming the first bad field, under `prefix` (e.g. `seed_session`; a call
 * may name another, as a part of a body does).
 */
export function compileWire<W>(
  schema: object,
  defaultPrefix = '',
): (body: unknown, prefix?: string) => W {
  const validate = ajv.compile<W>(schema);
  return (body, prefix = defaultPrefix) => {
    if (validate(body)) return body;
    const first = validate.errors?.[0];
    throw new InvalidRequestError(
      first ? describe(first, prefix) : `${prefix || 'body'}: does not match its schema`,
    );
  };
}

/** A rule no schema can say (names unique, say), refused as a schema refusal is. */
export function refuse(path: string, reason: string): never {
  throw new InvalidRequestError(`${path}: ${reason}`);
}
