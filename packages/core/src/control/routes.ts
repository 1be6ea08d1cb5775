/**
 * The control routes under `/ng-control/v1/checkpoint/`: `GET status`; `POST prepare, renew,
 * retire, forget, commit, restore, resume`. The bearer token is checked first, in constant time,
 * before the body is even read; then the body is parsed and validated once; then the plane runs
 * under an AbortSignal tied to the client's connection. Every failure is a JSON error.
 */
import { timingSafeEqual } from 'node:crypto';
import type { IncomingHttpHeaders } from 'node:http';

import express, { type Express, type Request, type RequestHandler, type Router } from 'express';

import { CHECKPOINT_ROUTE_PREFIX } from '../coordination.js';
import { ConfigError, UnauthorizedError } from '../errors.js';
import { errorMiddleware, jsonBody, requestSignal } from '../express.js';
import type { Logger } from '../logging.js';
import { inOperationSpan } from '../telemetry/checkpoint-spans.js';
import type { MetricsJson } from '../telemetry/metrics.js';
import type { CheckpointRecord } from '../store.js';
import { ControlPlane } from './plane.js';
import {
  CONTROL_ROUTES,
  CONTROL_VALIDATORS,
  type ControlRequests,
  type ControlRoute,
} from './schemas.js';

/** Commit and restore bodies name every continued episode: 100k ids are about 5 MB. */
export const DEFAULT_CONTROL_BODY_LIMIT = '64mb';

export interface ControlRouterOptions {
  /** The `checkpoint.control_auth_token`; must not be empty. */
  token: string;
  bodyLimit?: string | number;
  logger?: Logger;
}

/**
 * The request's one `Authorization` value, or '' when it has none or several: node keeps the first
 * of repeated headers in `req.headers`, so they are counted in `rawHeaders`.
 */
function soleAuthorization(req: Request): string {
  const raw = req.rawHeaders;
  let value = '';
  let count = 0;
  for (let i = 0; i < raw.length; i += 2) {
    if (raw[i]!.toLowerCase() === 'authorization') {
      count += 1;
      value = raw[i + 1]!;
    }
  }
  return count === 1 ? value : '';
}

/**
 * Accepts exactly one `Authorization: Bearer <token>` header (case-sensitive, one space, no
 * trimming). The comparison takes the same time whatever the header holds, so the token cannot be
 * guessed byte by byte. HTTP strips whitespace around a header value, so a token with whitespace at
 * either end could never be sent exactly: it is a configuration error.
 */
export function bearerAuth(token: string): RequestHandler {
  if (token !== token.trim()) {
    throw new ConfigError(
      'the checkpoint control_auth_token must not start or end with whitespace',
    );
  }
  const expected = Buffer.from(`Bearer ${token}`, 'utf8');
  return (req, _res, next) => {
    const given = Buffer.from(soleAuthorization(req), 'utf8');
    const sameLength = given.length === expected.length;
    // Compare equal-length buffers either way so a length mismatch costs the same as a byte mismatch.
    const equal = timingSafeEqual(sameLength ? given : expected, expected) && sameLength;
    next(
      equal
        ? undefined
        : new UnauthorizedError('missing or invalid checkpoint control bearer token'),
    );
  };
}

/**
 * Where the control routes send a call once the bearer token is checked: the process's own plane
 * (`planeTarget`), or — in a worker of a server with several workers — the link that forwards it
 * to the coordinator's plane, so the caller gets exactly what that plane replies.
 */
export interface ControlTarget {
  status(): object | Promise<object>;
  /**
   * Runs one POST route on its body as received (the plane validates it once), in its
   * `gym.checkpoint.<route>` span under the caller's trace context (`trace`: its W3C headers).
   */
  call(
    route: ControlRoute,
    body: unknown,
    signal: AbortSignal,
    trace?: Readonly<Record<string, string>>,
  ): Promise<object>;
  /** The coordinator's metrics, for a worker's scrape (a server with several workers only). */
  metrics?(): Promise<MetricsJson>;
}

/**
 * A control reply already encoded as the JSON text `res.json` writes for it: a worker sends the
 * coordinator's text as it came, instead of decoding it and encoding it again (a commit reply at
 * 8k rollouts is ~1 MB of staging keys, on the commit's own time).
 */
export class EncodedReply {
  constructor(readonly json: Uint8Array) {}
}

/** Sends a route's reply: an encoded one as its bytes, any other with `res.json`. */
function sendReply(res: express.Response, reply: object): void {
  if (!(reply instanceof EncodedReply)) {
    res.json(reply);
    return;
  }
  res.set('Content-Type', 'application/json; charset=utf-8');
  res.send(Buffer.from(reply.json.buffer, reply.json.byteOffset, reply.json.byteLength));
}

/** The control target of a plane: validates the body once, then runs the route. */
export function planeTarget<R extends CheckpointRecord>(plane: ControlPlane<R>): ControlTarget {
  return {
    status: () => plane.status(),
    call: (route, body, signal, trace = {}) => {
      // Looked up per request (not captured) so the one validation is observable.
      const valid = CONTROL_VALIDATORS[route](body);
      const run = () => dispatch(plane, route, valid, signal);
      return inOperationSpan(route, plane.participant, valid.checkpoint_id, trace, run);
    },
  };
}

/** The W3C trace context headers of a control call, the only ones a forwarded call carries on. */
function traceHeaders(headers: IncomingHttpHeaders): Record<string, string> {
  const trace: Record<string, string> = {};
  for (const name of ['traceparent', 'tracestate']) {
    const value = headers[name];
    if (typeof value === 'string') trace[name] = value;
  }
  return trace;
}

function dispatch<R extends CheckpointRecord>(
  plane: ControlPlane<R>,
  route: ControlRoute,
  body: ControlRequests[ControlRoute],
  signal: AbortSignal,
): Promise<object> {
  switch (route) {
    case 'prepare':
      return plane.prepare(body as ControlRequests['prepare'], signal);
    case 'renew':
      return plane.renew(body);
    case 'retire':
      return plane.retire(body as ControlRequests['retire'], signal);
    case 'forget':
      return plane.forget(body as ControlRequests['forget']);
    case 'commit':
      return plane.commit(body as ControlRequests['commit'], signal);
    case 'restore':
      return plane.restore(body as ControlRequests['restore'], signal);
    case 'resume':
      return plane.resume(body, signal);
  }
}

export function controlRouter<R extends CheckpointRecord>(
  plane: ControlPlane<R> | ControlTarget,
  options: ControlRouterOptions,
): Router {
  const target = plane instanceof ControlPlane ? planeTarget(plane) : plane;
  if (!options.token) {
    throw new ConfigError('checkpoint control routes need a non-empty control_auth_token');
  }
  const router = express.Router();
  router.use(bearerAuth(options.token));
  const json = jsonBody(options.bodyLimit ?? DEFAULT_CONTROL_BODY_LIMIT);
  router.get('/status', async (_req, res) => {
    res.json(await target.status());
  });
  for (const route of CONTROL_ROUTES) {
    router.post(`/${route}`, json, async (req, res) => {
      sendReply(
        res,
        await target.call(route, req.body, requestSignal(req, res), traceHeaders(req.headers)),
      );
    });
  }
  router.use(errorMiddleware(options.logger));
  return router;
}

/**
 * Mounts the control routes on `app`. Call it only when checkpointing is enabled: a server without
 * the routes answers 404, which is how discovery tells it takes no part.
 */
export function installControlPlane<R extends CheckpointRecord>(
  app: Express,
  plane: ControlPlane<R> | ControlTarget,
  token: string,
  options: Omit<ControlRouterOptions, 'token'> = {},
): void {
  app.use(CHECKPOINT_ROUTE_PREFIX, controlRouter(plane, { ...options, token }));
}
