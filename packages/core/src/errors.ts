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
  // `backoff`: the server holds as many connections as its descriptors allow; one closes soon.
  overloaded: {
    status: 503,
    retry: 'backoff',
    meaning: 'the server is at its connection bound; data requests are refused until load drops',
  },
} as const satisfies Record<string, { status: number; retry: RetryRule; meaning: string }>;

export type ErrorCode = keyof typeof ERROR_CATALOGUE;

/** Base of every typed ckpt-gym error. */
export class CkptGymError extends Error {
  readonly code: ErrorCode;
  readonly status: number;

  constructor(code: ErrorCode, detail: string, options?: { cause?: unknown }) {
    super(detail, options);
    this.name = new.target.name;
    this.code = code;
    this.status = ERROR_CATALOGUE[code].status;
  }

  get detail(): string {
    return this.message;
  }

  toBody(): ErrorBody {
    return { error: { code: this.code, detail: this.message } };
  }
}

function errorClass<C extends ErrorCode>(code: C) {
  return class extends CkptGymError {
    declare readonly code: C;
    constructor(detail: string, options?: { cause?: unknown }) {
      super(code, detail, options);
    }
  };
}

export class CheckpointError extends errorClass('checkpoint_error') {}
export class StaleCheckpointError extends errorClass('stale_checkpoint') {}
export class CheckpointConflictError extends errorClass('checkpoint_conflict') {}
export class InvalidPhaseError extends errorClass('invalid_phase') {}
export class DeadlineExceededError extends errorClass('deadline_exceeded') {}
export class ExportFailedError extends errorClass('export_failed') {}
export class RestartInScopeError extends errorClass('restart_in_scope') {}
export class RetireIncompleteError extends errorClass('retire_incomplete') {}
export class StaleAttemptError extends errorClass('stale_attempt') {}
export class AdmissionClosedError extends errorClass('admission_closed') {}
export class ActivationOutOfOrderError extends errorClass('activation_out_of_order') {}
export class RolloutIdRequiredError extends errorClass('rollout_id_required') {}
export class InvalidRolloutIdError extends errorClass('invalid_rollout_id') {}
export class UnauthorizedError extends errorClass('unauthorized') {}
export class NotFoundError extends errorClass('not_found') {}
export class RolloutRetiredError extends errorClass('rollout_retired') {}
export class CheckpointStateError extends errorClass('invalid_checkpoint_state') {}
export class InvalidRequestError extends errorClass('invalid_request') {}
export class PayloadTooLargeError extends errorClass('payload_too_large') {}
export class ConfigError extends errorClass('invalid_config') {}
export class InternalError extends errorClass('internal_error') {}
export class UpstreamError extends errorClass('upstream_error') {}
export class MalformedRequestError extends errorClass('malformed_request') {}
export class HeadersTooLargeError extends errorClass('headers_too_large') {}
export class OverloadedError extends errorClass('overloaded') {}

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
