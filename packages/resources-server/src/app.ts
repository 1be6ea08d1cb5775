/**
 * Builds a resources server from a definition on core's gym app: session starts, `/close_session`,
 * `/verify`, `/aggregate_metrics` and one `POST /<tool>` per tool, all behind the
 * `/ng-rollout/<capture key>` prefix middleware, with a signed session cookie. With checkpointing
 * on, every session route goes through the resources participant.
 */
import {
  CHECKPOINT_CLOSE_FOLLOWS_HEADER,
  CHECKPOINT_RESTART_HEADER,
  CHECKPOINT_VERIFY_HEADER,
  type CheckpointSettings,
  ConfigError,
  type ControlPlane,
  createGymApp,
  createLogger,
  type EpisodeId,
  InvalidRequestError,
  type JsonObject,
  type JsonValue,
  jsonBody,
  type Logger,
  requestEpisode,
  requestSignal,
} from '@ckpt-gym/core';
import type { Express, Request, RequestHandler, Response } from 'express';

import { newSessionId, SessionCookie, sessionSecret } from './cookie.js';
import {
  AGGREGATE_ROUTE,
  checkDefinition,
  CLOSE_ROUTE,
  type Declarations,
  type HandlerContext,
  mcpExposureProblem,
  type ResourcesServerDefinition,
  SEED_ROUTE,
  VERIFY_ROUTE,
} from './definition.js';
import {
  checkPrefixMatches,
  isNativeBody,
  NativeSessions,
  parseNativeClose,
  parseNativeSeed,
} from './native.js';
import {
  type RequestRole,
  type ResourcesParticipant as Participant,
  ResourcesParticipant,
  type ResourcesSessionRecord,
} from './participant.js';

export const DEFAULT_BODY_LIMIT = '16mb';

export interface ResourcesServerOptions {
  /** The server's name in the stack file; its checkpoint instance and cookie name. */
  readonly name: string;
  /** Undefined when checkpointing is off. */
  readonly checkpoint: CheckpointSettings | undefined;
  readonly logger?: Logger;
  /** `expose_tools_over_mcp`: refused (planned work). */
  readonly exposeToolsOverMcp?: boolean;
  /** `session_secret`: signs the session cookie; see cookie.ts for the default. */
  readonly sessionSecret?: string;
  readonly bodyLimit?: string;
}

export interface ResourcesServer {
  readonly app: Express;
  readonly logger: Logger;
  readonly declarations: Declarations;
  /** Present exactly when checkpointing is on. */
  readonly participant: ResourcesParticipant | undefined;
  readonly plane: ControlPlane<ResourcesSessionRecord> | undefined;
}

function objectBody(value: unknown): JsonObject {
  if (value === undefined) return {};
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw new InvalidRequestError('the request body must be a JSON object');
  }
  return value as JsonObject;
}

function isObject(value: JsonValue | undefined): value is JsonObject {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function withoutKey(body: JsonObject, key: string): JsonObject {
  const rest: JsonObject = {};
  for (const [k, v] of Object.entries(body)) if (k !== key) rest[k] = v;
  return rest;
}

/** The default `/aggregate_metrics`: how many verifications and their mean reward. */
export function meanRewardMetrics(verifyResponses: readonly JsonObject[]): JsonObject {
  const rewards = verifyResponses
    .map((r) => r.reward)
    .filter((r): r is number => typeof r === 'number');
  const total = rewards.reduce((sum, r) => sum + r, 0);
  return {
    count: verifyResponses.length,
    mean_reward: rewards.length ? total / rewards.length : 0,
  };
}

interface Outcome {
  readonly sessionId: string;
  readonly reply: JsonValue;
}

interface Route {
  readonly role: RequestRole;
  readonly path: string;
  /** The session the request is on, read before admission (a bad native body fails here). */
  sessionOf(body: JsonObject, cookieId: string | undefined, req: Request): string;
  run(ctx: HandlerContext): Promise<Outcome>;
}

export function createResourcesServer(
  definition: ResourcesServerDefinition,
  options: ResourcesServerOptions,
): ResourcesServer {
  const declarations = checkDefinition(definition);
  const mcp = mcpExposureProblem(
    options.exposeToolsOverMcp === true,
    options.checkpoint !== undefined,
  );
  if (mcp) throw new ConfigError(`server ${options.name}: ${mcp}`);

  const logger = options.logger ?? createLogger({ server: options.name, kind: 'resources' });
  const book = new NativeSessions();
  const participant: Participant | undefined = options.checkpoint
    ? new ResourcesParticipant(options.name, declarations, {
        logger,
        onSessionFreed: (id) => book.forget(id),
      })
    : undefined;
  const gym = createGymApp<ResourcesSessionRecord>({
    name: options.name,
    kind: 'resources',
    checkpoint: options.checkpoint,
    participant,
    logger,
  });
  const cookie = new SessionCookie(
    options.name,
    sessionSecret({
      configured: options.sessionSecret,
      controlAuthToken: options.checkpoint?.controlAuthToken,
      serverName: options.name,
    }),
  );
  const app = gym.app;
  app.use(jsonBody(options.bodyLimit ?? DEFAULT_BODY_LIMIT));

  const serve =
    (route: Route): RequestHandler =>
    async (req, res) => {
      const body = objectBody(req.body);
      const episode = requestEpisode(req);
      const cookieId = cookie.read(req.headers.cookie);
      const sessionId = route.sessionOf(body, cookieId, req);
      const signal = requestSignal(req, res);
      try {
        await handle(route, req, res, { body, episode, cookieId, sessionId, signal });
      } catch (err) {
        // The client is gone: nobody reads the reply, and its going away is not a server error.
        if (signal.aborted) {
          res.destroy();
          return;
        }
        throw err;
      }
    };

  const handle = async (
    route: Route,
    req: Request,
    res: Response,
    r: {
      body: JsonObject;
      episode: EpisodeId | undefined;
      cookieId: string | undefined;
      sessionId: string;
      signal: AbortSignal;
    },
  ): Promise<void> => {
    const { body, episode, cookieId, sessionId, signal } = r;
    const admission = await participant?.admit({
      role: route.role,
      path: route.path,
      sessionId,
      episode,
      closeFollows: req.get(CHECKPOINT_CLOSE_FOLLOWS_HEADER) === '1',
      signal,
    });
    try {
      let endRequested = false;
      const outcome = await route.run({
        sessionId,
        episode,
        body,
        signal,
        endSession: () => {
          endRequested = true;
        },
      });
      // Applied before the reply is written: a client that goes away now cannot undo it.
      admission?.succeeded(outcome.sessionId, endRequested);
      if (route.role === 'start' && participant) {
        res.setHeader(CHECKPOINT_VERIFY_HEADER, participant.verify);
        if (participant.mode === 'restart_only') res.setHeader(CHECKPOINT_RESTART_HEADER, '1');
      }
      if (outcome.sessionId !== cookieId)
        res.append('Set-Cookie', cookie.header(outcome.sessionId));
      res.json(outcome.reply);
    } finally {
      admission?.release();
    }
  };

  const cookieSession = (_body: JsonObject, cookieId: string | undefined): string =>
    cookieId ?? newSessionId();

  // --- session starts ---
  app.post(
    SEED_ROUTE,
    serve({
      role: 'start',
      path: SEED_ROUTE,
      sessionOf: (body, cookieId, req) => {
        if (!isNativeBody(body)) return cookieSession(body, cookieId);
        const seed = parseNativeSeed(body);
        checkPrefixMatches(seed.episode, requestEpisode(req));
        return seed.resourcesSessionId;
      },
      run: async (ctx) => {
        const native = isNativeBody(ctx.body) ? parseNativeSeed(ctx.body) : undefined;
        if (native && !book.seed(native)) {
          return { sessionId: ctx.sessionId, reply: nativeSeedReply(ctx.sessionId) };
        }
        let result;
        try {
          result = await definition.seedSession?.({ ...ctx, native });
        } catch (err) {
          // Not seeded after all: a retry must run the handler again.
          if (native) book.forget(native.resourcesSessionId);
          throw err;
        }
        if (native) return { sessionId: ctx.sessionId, reply: nativeSeedReply(ctx.sessionId) };
        return { sessionId: result?.sessionId ?? ctx.sessionId, reply: result?.reply ?? {} };
      },
    }),
  );

  // --- session end and verification ---
  app.post(
    CLOSE_ROUTE,
    serve({
      role: 'close',
      path: CLOSE_ROUTE,
      sessionOf: (body, cookieId, req) => {
        if (!isNativeBody(body)) return cookieSession(body, cookieId);
        const close = parseNativeClose(body);
        checkPrefixMatches(close.episode, requestEpisode(req));
        return close.resourcesSessionId;
      },
      run: async (ctx) => {
        const episode = isNativeBody(ctx.body) ? parseNativeClose(ctx.body).episode : undefined;
        book.close(ctx.sessionId, episode);
        await definition.closeSession?.(ctx.sessionId);
        return { sessionId: ctx.sessionId, reply: { resources_session_id: ctx.sessionId } };
      },
    }),
  );

  app.post(
    VERIFY_ROUTE,
    serve({
      role: 'verify',
      path: VERIFY_ROUTE,
      sessionOf: cookieSession,
      run: async (ctx) => {
        const input = ctx.body.verification_input;
        const result = await definition.verify({
          ...ctx,
          response: ctx.body.response,
          taskData: isObject(input) ? input : withoutKey(ctx.body, 'response'),
          seededTaskData: book.taskData(ctx.sessionId),
        });
        return {
          sessionId: ctx.sessionId,
          reply: { ...ctx.body, ...(result.extra ?? {}), reward: result.reward },
        };
      },
    }),
  );

  app.post(AGGREGATE_ROUTE, (req, res) => {
    const responses = objectBody(req.body).verify_responses ?? [];
    if (!Array.isArray(responses) || !responses.every(isObject)) {
      throw new InvalidRequestError('verify_responses: must be a list of objects');
    }
    res.json((definition.aggregateMetrics ?? meanRewardMetrics)(responses));
  });

  // --- tools (a declared session start among them starts a session) ---
  for (const [name, handler] of Object.entries(definition.tools)) {
    const path = `/${name}`;
    app.post(
      path,
      serve({
        role: declarations.sessionStarts.includes(path) ? 'start' : 'tool',
        path,
        sessionOf: cookieSession,
        run: async (ctx) => ({ sessionId: ctx.sessionId, reply: await handler(ctx) }),
      }),
    );
  }

  gym.finish();
  return { app, logger: gym.logger, declarations, participant, plane: gym.plane };
}

function nativeSeedReply(sessionId: string): JsonObject {
  return { resources_session_id: sessionId, resources_tools: null, sandbox_access: null };
}
