/**
 * The first middleware of every gym app: gives the request its id (echoed on the reply, passed on
 * by every call its work makes), and when the response closes, observes it in the HTTP histogram,
 * counts the error code the one error path answered, and writes the access line. Routes are named
 * by their template (`/v1/responses`, `/ng-control/v1/checkpoint/prepare`), never the raw path.
 */
import type { Request, RequestHandler, Response } from 'express';

import { answeredErrorCode } from '../express.js';
import { captureKey, requestEpisode } from '../identity.js';
import type { Logger, LogLevel, LogMeta } from '../logging.js';
import type { GymMetrics } from './metrics.js';
import { REQUEST_ID_HEADER, requestIdFor, withRequestScope } from './request-id.js';

/**
 * The level of the access line: below the default (`info`), so a server writes it only when
 * asked (`CKPT_GYM_LOG_LEVEL=debug`; the throughput bench does, for its per-hop latencies).
 */
export const ACCESS_LOG_LEVEL: LogLevel = 'debug';

/** What a request that matched no route is called in metrics and access lines. */
export const UNMATCHED_ROUTE = '(unmatched)';

/** The route template that served `req` (its router's mount path and its declared path). */
export function routeTemplate(req: Request): string {
  const route = (req as { route?: { path?: unknown } }).route;
  return typeof route?.path === 'string' ? `${req.baseUrl}${route.path}` : UNMATCHED_ROUTE;
}

/**
 * The access line of one request that has ended: `aborted` when the client left before the reply
 * was written.
 */
export function accessLine(req: Request, res: Response, requestId: string, ms: number): LogMeta {
  const episode = requestEpisode(req);
  return {
    method: req.method,
    route: routeTemplate(req),
    status: res.statusCode,
    ms: Math.round(ms * 1000) / 1000,
    capture_key: episode === undefined ? null : captureKey(episode),
    request_id: requestId,
    ...(res.writableFinished ? {} : { aborted: true }),
  };
}

/**
 * The access logger, when `logger` writes ACCESS_LOG_LEVEL (winston's `isLevelEnabled`; a logger
 * that cannot say, like a test's, writes no access lines): by default a request builds no line.
 */
export function accessLogger(logger: Logger): Logger | undefined {
  const enabled = (logger as { isLevelEnabled?: (level: string) => boolean }).isLevelEnabled;
  return enabled?.call(logger, ACCESS_LOG_LEVEL) === true ? logger : undefined;
}

/** The request middleware (see the file comment). */
export function requestTelemetry(metrics: GymMetrics, logger: Logger): RequestHandler {
  const access = accessLogger(logger);
  return (req, res, next) => {
    const id = requestIdFor(req.headers[REQUEST_ID_HEADER]);
    const start = performance.now();
    res.setHeader(REQUEST_ID_HEADER, id);
    res.once('close', () => {
      const ms = performance.now() - start;
      metrics.observeRequest(req.method, routeTemplate(req), res.statusCode, ms);
      const code = answeredErrorCode(res);
      if (code !== undefined) metrics.countEvent('refused', { code });
      access?.debug('request', accessLine(req, res, id, ms));
    });
    withRequestScope({ id, logger }, next);
  };
}
