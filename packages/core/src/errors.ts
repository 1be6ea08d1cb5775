/**
 * The error catalogue: every refusal a ckpt-gym server or the coordinator can give, each with a
 * stable `code`, HTTP status and retry rule. Clients see `{"error": {"code", "detail"}}` and
 * nothing else. docs/errors.md lists every code with when it is raised.
 */

export interface ErrorBody {
  error: { code: string; detail: string };
}

/**
 * When a client may send a refused request again:
 * - `never`: sending it again does not help (or must not run it twice) until someone acts.
 * - `after_resume`: once the open checkpoint is resumed (poll; the refusal owns no state).
 * - `backoff`: after a pause that grows, because the cause is transient.
 */
export type RetryRule = 'never' | 'after_resume' | 'backoff';

/**
 * The catalogue: code → HTTP status, retry rule and what it means. The single source of truth for
 * codes; replies carry `x-should-retry` from the rule (see `shouldRetry`).
 */
export const ERROR_CATALOGUE = {
  // `never`: the controller decides; e.g. coordination retires again after a failed retire hook,
  // and a resent agent call could run its activation twice.
  checkpoint_error: {
    status: 409,
    retry: 'never',
    meaning: 'a participant refused a checkpoint operation',
  },
  stale_checkpoint: {
    status: 409,
    retry: 'never',
    meaning: 'the checkpoint id was already resumed',
  },
  // `never`: waiting for another controller's checkpoint would race it, and a retry with other
  // arguments conflicts for good.
  checkpoint_conflict: {
    status: 409,
    retry: 'never',
    meaning:
      'another checkpoint is open, or a completed operation was retried with other arguments',
  },
  // `never`: the phase changes only by another control call (resume first), not by waiting.
  invalid_phase: {
    status: 409,
    retry: 'never',
    meaning: 'the operation is not valid in the current phase',
  },
  // `backoff`: bounded work ran out of time, not refused; a resume that could not wait for a
  // cleanup keeps its phase and succeeds when sent again (with a fresh `deadline_ts`).
  deadline_exceeded: {
    status: 409,
    retry: 'backoff',
    meaning: 'the deadline passed before the work finished; retry with a fresh deadline',
  },
  export_failed: {
    status: 409,
    retry: 'never',
    meaning: 'the export of this checkpoint failed for good; resume and prepare a new checkpoint',
  },
  restart_in_scope: {
    status: 409,
    retry: 'never',
    meaning: 'the commit scope names an episode that restarts',
  },
  // `never`: only a retire that frees the state ends it; the controller retires again first.
  retire_incomplete: {
    status: 409,
    retry: 'never',
    meaning: 'forget refused: a retired attempt still holds state on this server',
  },
  stale_attempt: {
    status: 409,
    retry: 'never',
    meaning: 'the attempt was retired or is not the owning attempt',
  },
  admission_closed: {
    status: 409,
    retry: 'after_resume',
    meaning: 'new work is refused while a checkpoint is open; send it again after resume',
  },
  activation_out_of_order: {
    status: 409,
    retry: 'never',
    meaning: 'an agent activation index skips or repeats out of order',
  },
  rollout_id_required: {
    status: 400,
    retry: 'never',
    meaning: 'the request must carry a rollout id',
  },
  invalid_rollout_id: {
    status: 400,
    retry: 'never',
    meaning: 'the rollout id or capture key is malformed',
  },
  unauthorized: { status: 401, retry: 'never', meaning: 'missing or invalid control bearer token' },
  not_found: { status: 404, retry: 'never', meaning: 'no such route or resource' },
  rollout_retired: {
    status: 410,
    retry: 'never',
    meaning: "the rollout attempt's capture ledger was retired",
  },
  invalid_checkpoint_state: {
    status: 422,
    retry: 'never',
    meaning: 'checkpoint storage is missing, corrupt, or cannot be written',
  },
  invalid_request: {
    status: 422,
    retry: 'never',
    meaning: 'the request body or parameters failed validation',
  },
  payload_too_large: {
    status: 413,
    retry: 'never',
    meaning: 'the request body is larger than the server accepts',
  },
  invalid_config: {
    status: 500,
    retry: 'never',
    meaning: 'the stack file or a server setting is invalid (startup)',
  },
  // `backoff`: an unexpected failure may be transient, and any 5xx is retried already by the
  // openai SDK and the environment server's episode rule; a model call whose ledger write failed
  // (poisoned) sent no answer, so its retry repeats nothing delivered.
  internal_error: {
    status: 500,
    retry: 'backoff',
    meaning: 'an unexpected server error; details are in the logs',
  },
  upstream_error: {
    status: 502,
    retry: 'backoff',
    meaning: 'a server this one called could not be reached or gave an unusable answer',
  },
  malformed_request: {
    status: 400,
    retry: 'never',
    meaning: 'the HTTP request could not be parsed (request line, headers or framing)',
  },
  headers_too_large: {
    status: 431,
    retry: 'never',
    meaning: 'the request headers are larger than the server accepts',
  },
  // `backoff`: a worker's coordinator stalled or its connection dropped; the caller may fall back
  // (a cut claim regenerates) or send the control call again.
  checkpoint_coordinator_unavailable: {
    status: 503,
    retry: 'backoff',
    meaning: "a server worker could not reach its process's checkpoint coordinator in time",
  },
  // `backoff`: the server holds as many connections as its descriptors allow; one closes soon.
  overloaded: {
    status: 503,
    retry: 'backoff',
    meaning: 'the server is at its connection bound; data requests are refused until load drops',
  },
} as const satisfies Record<string, { status: number; retry: RetryRule; meaning: string }>;

export type ErrorCode = keyof typeof ERROR_CATALOGUE;

/**
 * Marks every `CkptGymError`, under a key shared by every copy of this module (`Symbol.for`), so an
 * error thrown by a participant built against another install of @ckpt-gym/core is still typed
 * here: `toClientError` passes it through instead of hiding it behind a 500.
 */
const CKPT_GYM_ERROR = Symbol.for('@ckpt-gym/core.CkptGymError');

/**
 * Base of every typed ckpt-gym error. Each code has its own subclass below, written out (not made by
 * a factory) so the published `.d.ts` keeps `extends CkptGymError` and a narrowed `code`.
 */
export class CkptGymError extends Error {
  readonly code: ErrorCode;
  readonly status: number;

  constructor(code: ErrorCode, detail: string, options?: { cause?: unknown }) {
    super(detail, options);
    this.name = new.target.name;
    this.code = code;
    this.status = ERROR_CATALOGUE[code].status;
  }

  /**
   * `instanceof CkptGymError` holds for any copy's error (the brand); for a subclass it is the
   * usual prototype check, so `instanceof StaleAttemptError` stays exact.
   */
  static override [Symbol.hasInstance](value: unknown): boolean {
    if (this !== CkptGymError) return Function.prototype[Symbol.hasInstance].call(this, value);
    return isCkptGymError(value);
  }

  get detail(): string {
    return this.message;
  }

  toBody(): ErrorBody {
    return { error: { code: this.code, detail: this.message } };
  }
}
Object.defineProperty(CkptGymError.prototype, CKPT_GYM_ERROR, { value: true });

/** True for a `CkptGymError` from this or any other copy of @ckpt-gym/core. */
export function isCkptGymError(value: unknown): value is CkptGymError {
  return (
    typeof value === 'object' &&
    value !== null &&
    (value as { [CKPT_GYM_ERROR]?: unknown })[CKPT_GYM_ERROR] === true
  );
}

export class CheckpointError extends CkptGymError {
  declare readonly code: 'checkpoint_error';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('checkpoint_error', detail, options);
  }
}
export class StaleCheckpointError extends CkptGymError {
  declare readonly code: 'stale_checkpoint';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('stale_checkpoint', detail, options);
  }
}
export class CheckpointConflictError extends CkptGymError {
  declare readonly code: 'checkpoint_conflict';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('checkpoint_conflict', detail, options);
  }
}
export class InvalidPhaseError extends CkptGymError {
  declare readonly code: 'invalid_phase';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('invalid_phase', detail, options);
  }
}
export class DeadlineExceededError extends CkptGymError {
  declare readonly code: 'deadline_exceeded';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('deadline_exceeded', detail, options);
  }
}
export class ExportFailedError extends CkptGymError {
  declare readonly code: 'export_failed';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('export_failed', detail, options);
  }
}
export class RestartInScopeError extends CkptGymError {
  declare readonly code: 'restart_in_scope';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('restart_in_scope', detail, options);
  }
}
export class RetireIncompleteError extends CkptGymError {
  declare readonly code: 'retire_incomplete';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('retire_incomplete', detail, options);
  }
}
export class StaleAttemptError extends CkptGymError {
  declare readonly code: 'stale_attempt';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('stale_attempt', detail, options);
  }
}
export class AdmissionClosedError extends CkptGymError {
  declare readonly code: 'admission_closed';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('admission_closed', detail, options);
  }
}
export class ActivationOutOfOrderError extends CkptGymError {
  declare readonly code: 'activation_out_of_order';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('activation_out_of_order', detail, options);
  }
}
export class RolloutIdRequiredError extends CkptGymError {
  declare readonly code: 'rollout_id_required';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('rollout_id_required', detail, options);
  }
}
export class InvalidRolloutIdError extends CkptGymError {
  declare readonly code: 'invalid_rollout_id';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('invalid_rollout_id', detail, options);
  }
}
export class UnauthorizedError extends CkptGymError {
  declare readonly code: 'unauthorized';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('unauthorized', detail, options);
  }
}
export class NotFoundError extends CkptGymError {
  declare readonly code: 'not_found';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('not_found', detail, options);
  }
}
export class RolloutRetiredError extends CkptGymError {
  declare readonly code: 'rollout_retired';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('rollout_retired', detail, options);
  }
}
export class CheckpointStateError extends CkptGymError {
  declare readonly code: 'invalid_checkpoint_state';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('invalid_checkpoint_state', detail, options);
  }
}
export class InvalidRequestError extends CkptGymError {
  declare readonly code: 'invalid_request';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('invalid_request', detail, options);
  }
}
export class PayloadTooLargeError extends CkptGymError {
  declare readonly code: 'payload_too_large';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('payload_too_large', detail, options);
  }
}
export class ConfigError extends CkptGymError {
  declare readonly code: 'invalid_config';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('invalid_config', detail, options);
  }
}
export class InternalError extends CkptGymError {
  declare readonly code: 'internal_error';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('internal_error', detail, options);
  }
}
export class UpstreamError extends CkptGymError {
  declare readonly code: 'upstream_error';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('upstream_error', detail, options);
  }
}
export class MalformedRequestError extends CkptGymError {
  declare readonly code: 'malformed_request';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('malformed_request', detail, options);
  }
}
export class HeadersTooLargeError extends CkptGymError {
  declare readonly code: 'headers_too_large';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('headers_too_large', detail, options);
  }
}
export class OverloadedError extends CkptGymError {
  declare readonly code: 'overloaded';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('overloaded', detail, options);
  }
}
export class CoordinatorUnavailableError extends CkptGymError {
  declare readonly code: 'checkpoint_coordinator_unavailable';
  constructor(detail: string, options?: { cause?: unknown }) {
    super('checkpoint_coordinator_unavailable', detail, options);
  }
}

/** When a request refused with `code` may be sent again. */
export function retryRule(code: ErrorCode): RetryRule {
  return ERROR_CATALOGUE[code].retry;
}

/** Whether a client may send a request refused with `code` again (the `x-should-retry` header). */
export function shouldRetry(code: ErrorCode): boolean {
  return retryRule(code) !== 'never';
}

/** True for a code this catalogue defines. */
export function isErrorCode(code: unknown): code is ErrorCode {
  return typeof code === 'string' && Object.hasOwn(ERROR_CATALOGUE, code);
}

/**
 * Rebuilds a typed error from an upstream reply body, as a client sees it. A body that is not a
 * ckpt-gym error (an unknown code, HTML, a proxy's page) is a 502 `upstream_error`.
 */
export function errorFromBody(status: number, body: unknown): CkptGymError {
  const error = (body as ErrorBody | undefined)?.error;
  if (error && isErrorCode(error.code) && typeof error.detail === 'string') {
    return new CkptGymError(error.code, error.detail);
  }
  return new UpstreamError(`HTTP ${status}: ${JSON.stringify(body)?.slice(0, 200) ?? ''}`);
}

/** What body-parser and raw-body attach to an error: `expose` is true when the client caused it. */
interface BodyReadError {
  message?: unknown;
  status?: unknown;
  expose?: unknown;
  type?: unknown;
}

/**
 * The typed error for a failure to read a request body, or undefined for another error. body-parser
 * and raw-body give each failure an HTTP status, and `expose: true` to the 4xx ones a client caused:
 * bad JSON, too large a body, an unsupported charset or content encoding, a body shorter than its
 * content-length, and a compressed body that does not decompress (a zlib error, without a `type`).
 * Nothing else a gym server runs raises such errors.
 */
function bodyReadError(err: unknown): CkptGymError | undefined {
  const { message, status, expose, type } = (err ?? {}) as BodyReadError;
  if (expose !== true || typeof status !== 'number' || status < 400 || status > 499) {
    return undefined;
  }
  if (type === 'entity.too.large') return new PayloadTooLargeError('request body is too large');
  const reason = String(message);
  if (type === 'entity.parse.failed') {
    return new InvalidRequestError(`request body is not valid JSON: ${reason}`);
  }
  if (type === undefined) {
    return new InvalidRequestError(`request body could not be decompressed: ${reason}`);
  }
  return new InvalidRequestError(`request body could not be read: ${reason}`);
}

/**
 * The typed error for express's router refusing a path parameter, or undefined for another error:
 * a parameter that is not percent-encoded UTF-8 (`%ZZ`) is a URIError the router gives `status`
 * 400, before any route runs. It is the client's input, as a body's bad UTF-8 is: 422.
 */
function pathParameterError(err: unknown): CkptGymError | undefined {
  if (!(err instanceof URIError) || (err as { status?: unknown }).status !== 400) return undefined;
  return new InvalidRequestError(
    `a request path parameter is not percent-encoded UTF-8: ${err.message}`,
  );
}

/**
 * Turns anything thrown into the error a client may see: typed errors pass through, body-reading
 * failures become 422/413, an undecodable path parameter 422, everything else is a 500
 * `internal_error` whose detail hides internals.
 */
export function toClientError(err: unknown): CkptGymError {
  if (err instanceof CkptGymError) return err;
  return (
    bodyReadError(err) ?? pathParameterError(err) ?? new InternalError('internal server error')
  );
}
