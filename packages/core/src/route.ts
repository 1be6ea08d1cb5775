/**
 * One request lifecycle for every data-plane route (fastify's `lib/route.js` is the model): a route
 * is a declaration, and `gymRoute` turns it into the express handlers that run its stages in one
 * order — JSON body, object check and the route's parser, the rollout prefix rule, admission, the
 * handler, the reply, the release — with one abort signal for the client's connection and one
 * error path (`next(err)` to core's error middleware). `docs/lifecycle.md` draws it.
 */
import type { Request, RequestHandler, Response, Router } from 'express';

import { InvalidRequestError, RolloutIdRequiredError } from './errors.js';
import { jsonBody, requestSignal } from './express.js';
import { type EpisodeId, requestEpisode } from './identity.js';
import type { JsonObject } from './json.js';
import { traceRequest } from './telemetry/request-spans.js';

/**
 * What a route does with the `/ng-rollout/<key>` prefix (the app strips it before routing):
 * `required` refuses a request without one (400 `rollout_id_required`), `optional` hands the
 * episode over when there is one, `none` ignores it (the route names its episode in its body or
 * has none; a prefix is accepted, as on every route).
 */
export type EpisodeRule = 'required' | 'optional' | 'none';

/** How a route reads its JSON body. */
export interface BodyRule<B> {
  /** The most `jsonBody` reads (413 `payload_too_large` beyond it). */
  readonly limit: string | number;
  /**
   * The route's check of the JSON object (its wire contract's parser, built once with the route);
   * a bad body throws the 422 `invalid_request` it describes.
   */
  readonly parse: (body: JsonObject) => B;
  /** A request with no JSON body (none, or another content type) reads as `{}`, not a 422. */
  readonly absentIsEmpty?: boolean;
}

/** What the route's stages after the body see. */
export interface RequestContext<B> {
  readonly req: Request;
  readonly res: Response;
  readonly body: B;
  /** The prefix's episode; always undefined for an `episode: 'none'` route. */
  readonly episode: EpisodeId | undefined;
  /** Aborted when the client goes away before the reply finished: the route's work stops. */
  readonly signal: AbortSignal;
}

/** A data-plane route: what it reads, whether it waits for admission, what it does and answers. */
export interface GymRouteDeclaration<B, A, R> {
  readonly method: 'get' | 'post';
  readonly path: string;
  /** Absent: the route reads no body (`ctx.body` is undefined). */
  readonly body?: BodyRule<B>;
  readonly episode: EpisodeRule;
  /** Waits until the participant admits the request (its refusal is the error answered). */
  readonly admit?: (ctx: RequestContext<B>) => Promise<A>;
  /** Runs once the request is over (after the reply, or after a failure), for what `admit` gave. */
  readonly release?: (admitted: A) => void;
  readonly run: (ctx: RequestContext<B>, admitted: A) => Promise<R> | R;
  /**
   * Writes the result; by default `res.json(result)`. `'streamed'`: the handler wrote the
   * response itself (a stream), or nothing when its client left.
   */
  readonly reply?: ((res: Response, result: R, ctx: RequestContext<B>) => void) | 'streamed';
}

/** A declared route, ready to mount. */
export interface GymRoute {
  readonly method: 'get' | 'post';
  readonly path: string;
  readonly handlers: readonly RequestHandler[];
}

/** The body a route's parser gets: a JSON object, `{}` for none when the route allows it. */
export function objectBody(value: unknown, absentIsEmpty = false): JsonObject {
  if (value === undefined && absentIsEmpty) return {};
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw new InvalidRequestError('body: must be a JSON object');
  }
  return value as JsonObject;
}

/** The episode a route sees under its rule; a `required` one without the prefix is refused. */
export function routeEpisode(rule: EpisodeRule, episode: EpisodeId | undefined) {
  if (rule === 'none') return undefined;
  if (rule === 'required' && episode === undefined) {
    throw new RolloutIdRequiredError(
      'this route needs a rollout id: send it as the /ng-rollout/<id> prefix',
    );
  }
  return episode;
}

/** The stages after the body is read, in their order; a throw anywhere is the request's error. */
async function serve<B, A, R>(
  route: GymRouteDeclaration<B, A, R>,
  req: Request,
  res: Response,
  signal: AbortSignal,
): Promise<void> {
  const body = route.body
    ? route.body.parse(objectBody(req.body, route.body.absentIsEmpty))
    : (undefined as B);
  const episode = routeEpisode(route.episode, requestEpisode(req));
  const ctx: RequestContext<B> = { req, res, body, episode, signal };
  const admitted = route.admit ? await route.admit(ctx) : (undefined as A);
  try {
    const result = await route.run(ctx, admitted);
    if (route.reply === undefined) res.json(result);
    else if (route.reply !== 'streamed') route.reply(res, result, ctx);
  } finally {
    route.release?.(admitted);
  }
}

/**
 * The express handlers of a declared route. A failure goes to `next` (core's error middleware
 * answers it as JSON); once the client is gone nobody reads a reply, and its going away is no
 * server error: the socket is destroyed instead.
 */
export function gymRoute<B = undefined, A = undefined, R = unknown>(
  route: GymRouteDeclaration<B, A, R>,
): GymRoute {
  const handle: RequestHandler = async (req, res, next) => {
    const signal = requestSignal(req, res);
    try {
      await serve(route, req, res, signal);
    } catch (err) {
      if (signal.aborted) {
        res.destroy();
        return;
      }
      next(err);
    }
  };
  const handlers = [
    traceRequest(route.path),
    ...(route.body ? [jsonBody(route.body.limit)] : []),
    handle,
  ];
  return { method: route.method, path: route.path, handlers };
}

/** Mounts declared routes on an app or router, in order. */
export function mountRoutes(router: Router, routes: readonly GymRoute[]): void {
  for (const route of routes) router[route.method](route.path, ...route.handlers);
}
