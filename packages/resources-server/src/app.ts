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
  type EpisodeId,
  isNativeBody,
  type JsonObject,
  type JsonValue,
  parseAggregateMetricsRequest,
  requestEpisode,
} from '@ckpt-gym/core/protocol';
import {
  type CheckpointSettings,
  type ControlPlane,
  type ControlTarget,
  createGymApp,
  createLogger,
  gymRoute,
  type GymRoute,
  type Logger,
  mountRoutes,
  SessionRouter,
} from '@ckpt-gym/core/server';
import type { Express, Request } from 'express';

import { newSessionId, SessionCookie, sessionSecret } from './cookie.js';
import {
  AGGREGATE_ROUTE,
  checkDefinition,
  CLOSE_ROUTE,
  type Declarations,
  type HandlerContext,
  type ResourcesServerDefinition,
  SEED_ROUTE,
  VERIFY_ROUTE,
} from './definition.js';
import { type McpExposure, mcpRoutes, mcpToolNames, resourcesTools } from './mcp.js';
import { McpTokens, mcpTokenKey } from './mcp-token.js';
import { resourcesSessionOf } from './routing.js';
import { checkPrefixMatches, NativeSessions, parseNativeClose, parseNativeSeed } from './native.js';
import {
  type Admission,
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
  /** `expose_tools_over_mcp`: the tools at `POST /mcp` too (mcp.ts). */
  readonly exposeToolsOverMcp?: boolean;
  /** `session_secret`: signs the session cookie; see cookie.ts for the default. */
  readonly sessionSecret?: string;
  readonly bodyLimit?: string;
  /**
   * On a worker of a server with several workers: its routing id and the server's runtime
   * directory. Its new sessions name it, and a request for another worker's session goes there.
   */
  readonly routing?: { readonly routingId: string; readonly socketDir: string };
  /** On such a worker with checkpointing on: its control routes go to the coordinator. */
  readonly control?: ControlTarget;
}

export interface ResourcesServer {
  readonly app: Express;
  readonly logger: Logger;
  readonly declarations: Declarations;
  /** Present exactly when checkpointing is on. */
  readonly participant: ResourcesParticipant | undefined;
  readonly plane: ControlPlane<ResourcesSessionRecord> | undefined;
  /** Present exactly when `routing` was given: `listen` it on the worker's own socket. */
  readonly router: SessionRouter | undefined;
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

/** A session route of the table: its role for admission, its session, and its work. */
interface Route {
  readonly role: RequestRole;
  readonly path: string;
  /** The session the request is on, read before admission (a bad native body fails here). */
  sessionOf(body: JsonObject, cookieId: string | undefined, req: Request): string;
  run(ctx: HandlerContext): Promise<Outcome>;
}

/** What admission leaves a session route: the request's session and the participant's pass. */
interface Admitted {
  readonly cookieId: string | undefined;
  readonly sessionId: string;
  readonly admission: Admission | undefined;
}

/** Everything a resources server's routes share. */
interface ServerContext {
  readonly definition: ResourcesServerDefinition;
  readonly declarations: Declarations;
  readonly participant: Participant | undefined;
  readonly cookie: SessionCookie;
  readonly book: NativeSessions;
  readonly bodyLimit: string;
  /** Present when the tools are exposed over MCP. */
  readonly mcp: McpExposure | undefined;
}

export function createResourcesServer(
  definition: ResourcesServerDefinition,
  options: ResourcesServerOptions,
): ResourcesServer {
  const declarations = checkDefinition(definition);
  const logger = options.logger ?? createLogger({ server: options.name, kind: 'resources' });
  const book = new NativeSessions();
  const owner = options.routing?.routingId;
  const participant: Participant | undefined = options.checkpoint
    ? new ResourcesParticipant(options.name, declarations, {
        logger,
        onSessionFreed: (id) => book.forget(id),
        owner,
      })
    : undefined;
  const secret = sessionSecret({
    configured: options.sessionSecret,
    controlAuthToken: options.checkpoint?.controlAuthToken,
    serverName: options.name,
  });
  const cookie = new SessionCookie(options.name, secret, owner);
  const tokens = options.exposeToolsOverMcp ? new McpTokens(mcpTokenKey(secret), owner) : undefined;
  const router = options.routing
    ? new SessionRouter({
        ...options.routing,
        sessionOf: resourcesSessionOf(cookie, tokens),
        logger,
      })
    : undefined;
  const gym = createGymApp<ResourcesSessionRecord>({
    name: options.name,
    kind: 'resources',
    checkpoint: options.checkpoint,
    participant,
    control: options.control,
    logger,
    sessionRouter: router?.middleware(),
  });
  const bodyLimit = options.bodyLimit ?? DEFAULT_BODY_LIMIT;
  const mcp: McpExposure | undefined = tokens
    ? {
        serverName: options.name,
        definition,
        tools: mcpToolNames(definition, declarations),
        tokens,
        participant,
        logger: gym.logger,
        bodyLimit,
      }
    : undefined;
  const server: ServerContext = {
    definition,
    declarations,
    participant,
    cookie,
    book,
    bodyLimit,
    mcp,
  };
  mountRoutes(gym.app, [
    ...sessionRoutes(server).map((route) => sessionRoute(server, route)),
    aggregateRoute(server),
    ...(mcp ? mcpRoutes(mcp) : []),
  ]);
  gym.finish();
  return {
    app: gym.app,
    logger: gym.logger,
    declarations,
    participant,
    plane: gym.plane,
    router,
  };
}

/**
 * A session route on the lifecycle: its session is read and the participant admits it before
 * the handler runs; a success is applied to the participant before the reply is written (a
 * client that goes away then cannot undo it), and the admission is released after it.
 */
function sessionRoute(server: ServerContext, route: Route): GymRoute {
  const { participant, cookie } = server;
  return gymRoute({
    method: 'post',
    path: route.path,
    episode: 'optional',
    body: { limit: server.bodyLimit, parse: (body) => body, absentIsEmpty: true },
    admit: async ({ req, body, episode, signal }): Promise<Admitted> => {
      const cookieId = cookie.read(req.headers.cookie);
      const sessionId = route.sessionOf(body, cookieId, req);
      const admission = await participant?.admit({
        role: route.role,
        path: route.path,
        sessionId,
        episode,
        closeFollows: req.get(CHECKPOINT_CLOSE_FOLLOWS_HEADER) === '1',
        signal,
      });
      return { cookieId, sessionId, admission };
    },
    release: ({ admission }) => admission?.release(),
    run: async ({ res, body, episode, signal }, { cookieId, sessionId, admission }) => {
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
      admission?.succeeded(outcome.sessionId, endRequested);
      if (route.role === 'start' && participant) {
        res.setHeader(CHECKPOINT_VERIFY_HEADER, participant.verify);
        if (participant.mode === 'restart_only') res.setHeader(CHECKPOINT_RESTART_HEADER, '1');
      }
      if (outcome.sessionId !== cookieId) {
        res.append('Set-Cookie', cookie.header(outcome.sessionId));
      }
      return outcome.reply;
    },
  });
}

const cookieSession = (_body: JsonObject, cookieId: string | undefined): string =>
  cookieId ?? newSessionId();

/** A native body names its session, under the prefix's episode; a legacy one has the cookie's. */
function nativeOrCookieSession(
  parse: (body: JsonObject) => { resourcesSessionId: string; episode: EpisodeId },
): Route['sessionOf'] {
  return (body, cookieId, req) => {
    if (!isNativeBody(body)) return cookieSession(body, cookieId);
    const native = parse(body);
    checkPrefixMatches(native.episode, requestEpisode(req));
    return native.resourcesSessionId;
  };
}

/** The session routes: the seed, close and verify routes, and one per tool. */
function sessionRoutes(server: ServerContext): Route[] {
  const { definition, declarations } = server;
  const tools = Object.entries(definition.tools).map(([name, handler]): Route => {
    const path = `/${name}`;
    return {
      // A declared session start among the tools starts a session.
      role: declarations.sessionStarts.includes(path) ? 'start' : 'tool',
      path,
      sessionOf: cookieSession,
      run: async (ctx) => ({ sessionId: ctx.sessionId, reply: await handler(ctx) }),
    };
  });
  return [seedRoute(server), closeRoute(server), verifyRoute(server), ...tools];
}

function seedRoute({ definition, book, mcp }: ServerContext): Route {
  // With MCP exposure, a seed's reply carries the token of the session it started.
  const tools = (sessionId: string, episode: EpisodeId | undefined) =>
    mcp ? resourcesTools(mcp, sessionId, episode) : null;
  return {
    role: 'start',
    path: SEED_ROUTE,
    sessionOf: nativeOrCookieSession(parseNativeSeed),
    run: async (ctx) => {
      const native = isNativeBody(ctx.body) ? parseNativeSeed(ctx.body) : undefined;
      const nativeOutcome = (): Outcome => ({
        sessionId: ctx.sessionId,
        reply: nativeSeedReply(ctx.sessionId, tools(ctx.sessionId, ctx.episode)),
      });
      if (native && !book.seed(native)) return nativeOutcome();
      let result;
      try {
        result = await definition.seedSession?.({ ...ctx, native });
      } catch (err) {
        // Not seeded after all: a retry must run the handler again.
        if (native) book.forget(native.resourcesSessionId);
        throw err;
      }
      if (native) return nativeOutcome();
      const sessionId = result?.sessionId ?? ctx.sessionId;
      const reply = result?.reply ?? {};
      return {
        sessionId,
        reply: mcp ? { ...reply, resources_tools: tools(sessionId, ctx.episode) } : reply,
      };
    },
  };
}

function closeRoute({ definition, book }: ServerContext): Route {
  return {
    role: 'close',
    path: CLOSE_ROUTE,
    sessionOf: nativeOrCookieSession(parseNativeClose),
    run: async (ctx) => {
      const episode = isNativeBody(ctx.body) ? parseNativeClose(ctx.body).episode : undefined;
      book.close(ctx.sessionId, episode);
      await definition.closeSession?.(ctx.sessionId);
      return { sessionId: ctx.sessionId, reply: { resources_session_id: ctx.sessionId } };
    },
  };
}

function verifyRoute({ definition, book }: ServerContext): Route {
  return {
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
  };
}

/** `/aggregate_metrics`: no session, no admission. */
function aggregateRoute({ definition, bodyLimit }: ServerContext): GymRoute {
  return gymRoute({
    method: 'post',
    path: AGGREGATE_ROUTE,
    episode: 'none',
    body: {
      limit: bodyLimit,
      absentIsEmpty: true,
      parse: parseAggregateMetricsRequest,
    },
    run: (ctx) =>
      (definition.aggregateMetrics ?? meanRewardMetrics)(ctx.body.verify_responses ?? []),
  });
}

function nativeSeedReply(sessionId: string, tools: JsonObject | null): JsonObject {
  return { resources_session_id: sessionId, resources_tools: tools, sandbox_access: null };
}
