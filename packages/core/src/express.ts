/**
 * Express glue every server shares: JSON errors for every failure (never an HTML page or a stack
 * trace), a JSON 404 for unknown routes, and an abort signal tied to the client's connection.
 */
import { isUtf8 } from 'node:buffer';

import express, {
  type ErrorRequestHandler,
  type Request,
  type RequestHandler,
  type Response,
} from 'express';

import {
  type CkptGymError,
  InvalidRequestError,
  NotFoundError,
  shouldRetry,
  toClientError,
} from './errors.js';
import { nestsDeeperThan } from './json-pieces.js';

export interface ErrorLogger {
  error(message: string, meta?: Record<string, unknown>): void;
}

const answeredCodes = new WeakMap<Response, string>();

/** The error code `sendError` answered `res` with (what the events counter counts as refused). */
export function answeredErrorCode(res: Response): string | undefined {
  return answeredCodes.get(res);
}

/**
 * Writes a typed error as `{"error": {"code", "detail"}}` with `x-should-retry` from its code's
 * retry rule, which SDKs (the openai package) obey over their own status-based guess.
 */
export function sendError(res: Response, err: CkptGymError): void {
  if (res.headersSent) {
    res.destroy();
    return;
  }
  answeredCodes.set(res, err.code);
  res.setHeader('x-should-retry', String(shouldRetry(err.code)));
  res.status(err.status).json(err.toBody());
}

/** The last middleware of every app: answers any error as JSON; unknown errors are logged, not shown. */
export function errorMiddleware(logger?: ErrorLogger): ErrorRequestHandler {
  return (err: unknown, req, res, _next) => {
    const clientError = toClientError(err);
    if (clientError.code === 'internal_error' && logger) {
      logger.error('unhandled error', {
        method: req.method,
        path: req.originalUrl,
        error: err instanceof Error ? (err.stack ?? err.message) : String(err),
      });
    }
    sendError(res, clientError);
  };
}

/** Mounted after every route: an unknown path is a JSON 404 `not_found`. */
export function notFoundMiddleware(): RequestHandler {
  return (req, _res, next) => {
    next(new NotFoundError(`no route for ${req.method} ${req.path}`));
  };
}

/**
 * An AbortSignal that fires when the client goes away before the response finished, so the
 * request's work is cancelled (express has no such signal of its own).
 */
export function requestSignal(req: Request, res: Response): AbortSignal {
  const controller = new AbortController();
  res.on('close', () => {
    if (!res.writableFinished) controller.abort(new Error('client disconnected'));
  });
  return controller.signal;
}

const CHARSET = /;\s*charset\s*=\s*"?([^";\s]+)/i;

/**
 * The deepest a JSON body may nest arrays and objects. Gym payloads nest a few levels (OpenAI
 * requests and control bodies under 10; tool arguments are strings), and NeMo Gym's Python `json`
 * fails near 1,000 levels anyway. Recursive code on a body's way (the policy's `JSON.stringify` of
 * a request, ajv, a recursive walk or clone) overflows node's stack at a few thousand levels
 * (`JSON.stringify` near 4,000 levels, `structuredClone` or a one-frame recursive map near 3,000,
 * less inside a deep call stack): 512 keeps a wide margin. The scan costs a quarter of a
 * `JSON.parse` of the same body.
 */
export const MAX_JSON_BODY_DEPTH = 512;

/**
 * The value an `application/json` body holds (an empty body is `{}`). Refused with 422
 * `invalid_request`: a charset other than UTF-8, bytes that are not UTF-8 (decoding would replace
 * them with U+FFFD and change the payload unseen), nesting deeper than MAX_JSON_BODY_DEPTH, and
 * text that is not JSON.
 */
function decodeJsonBody(bytes: Buffer, contentType: string | undefined): unknown {
  const charset = CHARSET.exec(contentType ?? '')?.[1]?.toLowerCase();
  if (charset !== undefined && charset !== 'utf-8' && charset !== 'utf8') {
    throw new InvalidRequestError(`request body charset must be utf-8, not ${charset}`);
  }
  if (bytes.length === 0) return {};
  if (!isUtf8(bytes)) throw new InvalidRequestError('request body is not valid UTF-8');
  if (nestsDeeperThan(bytes, MAX_JSON_BODY_DEPTH)) {
    throw new InvalidRequestError(
      `request body nests deeper than ${MAX_JSON_BODY_DEPTH} levels of arrays and objects`,
    );
  }
  try {
    return JSON.parse(bytes.toString('utf8')) as unknown;
  } catch (parseError) {
    throw new InvalidRequestError(
      `request body is not valid JSON: ${(parseError as Error).message}`,
    );
  }
}

/**
 * Parses an `application/json` body of at most `limit` into `req.body` with `decodeJsonBody`
 * (another content type is left unparsed); every server reads JSON bodies through it. Like
 * `express.json` in what it accepts, but it decodes UTF-8 itself: `express.json` loads iconv-lite's
 * codec tables on a process's first body, which cost ~150 ms of CPU inside a fresh server's
 * restore. Too large a body is 413 `payload_too_large`; one whose content encoding is unsupported
 * or does not decompress is 422 `invalid_request` (see `toClientError`).
 */
export function jsonBody(limit: string | number): RequestHandler {
  const raw = express.raw({ type: 'application/json', limit });
  return (req, res, next) => {
    raw(req, res, (err?: unknown) => {
      if (err !== undefined) {
        next(err);
        return;
      }
      const bytes: unknown = req.body;
      if (!Buffer.isBuffer(bytes)) {
        next();
        return;
      }
      try {
        req.body = decodeJsonBody(bytes, req.headers['content-type']);
      } catch (decodeError) {
        next(decodeError);
        return;
      }
      next();
    });
  };
}
