/**
 * Express glue every server shares: JSON errors for every failure (never an HTML page or a stack
 * trace), a JSON 404 for unknown routes, and an abort signal tied to the client's connection.
 */
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

export interface ErrorLogger {
  error(message: string, meta?: Record<string, unknown>): void;
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
 * Parses an `application/json` body of at most `limit` into `req.body` (an empty body is `{}`;
 * another content type is left unparsed). Like `express.json` in what it accepts, but it decodes
 * UTF-8 itself: `express.json` loads iconv-lite's codec tables on a process's first body, which
 * cost ~150 ms of CPU inside a fresh server's restore. Bad JSON and charsets other than UTF-8 are
 * 422 `invalid_request`, too large a body is 413 `payload_too_large`.
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
      const charset = CHARSET.exec(req.headers['content-type'] ?? '')?.[1]?.toLowerCase();
      if (charset !== undefined && charset !== 'utf-8' && charset !== 'utf8') {
        next(new InvalidRequestError(`request body charset must be utf-8, not ${charset}`));
        return;
      }
      try {
        req.body = bytes.length === 0 ? {} : JSON.parse(bytes.toString('utf8'));
      } catch (parseError) {
        next(
          new InvalidRequestError(
            `request body is not valid JSON: ${(parseError as Error).message}`,
          ),
        );
        return;
      }
      next();
    });
  };
}
