/**
 * Express glue every server shares: JSON errors for every failure (never an HTML page or a stack
 * trace), a JSON 404 for unknown routes, and an abort signal tied to the client's connection.
 */
import type { ErrorRequestHandler, Request, RequestHandler, Response } from 'express';

import { type CkptGymError, NotFoundError, toClientError } from './errors.js';

export interface ErrorLogger {
  error(message: string, meta?: Record<string, unknown>): void;
}

/** Writes a typed error as `{"error": {"code", "detail"}}`; 409 refusals also tell SDKs not to retry. */
export function sendError(res: Response, err: CkptGymError): void {
  if (res.headersSent) {
    res.destroy();
    return;
  }
  if (err.status === 409) res.setHeader('x-should-retry', 'false');
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
