/**
 * `single_agent_turn`: seed a resources session and an agent session, activate the agent once,
 * close the agent, verify, return. Each stage starts with its boundary, so a checkpoint parks an
 * episode before any of its work, and a restored attempt continues at the recorded stage:
 *
 *   stage         step mode                         boundary payload
 *   seed          replay                            next, handles
 *   invoke_agent  replay                            next, handles
 *   close_agent   wait                              next, handles, response
 *   verify        from the resources seed reply     next, handles, response, observations
 *   return        (no step)                         next, handles, result, observations
 */
import { randomUUID } from 'node:crypto';

import { logTimedOutCall, postUpstream } from '@ckpt-gym/core/client';
import {
  activationHeader,
  type AgentCloseRequest,
  type AgentSeedRequest,
  CHECKPOINT_CLOSE_FOLLOWS_HEADER,
  CHECKPOINT_RESTART_HEADER,
  CHECKPOINT_VERIFY_HEADER,
  decodeJson,
  type DirectHttpGrant,
  encodeJson,
  episodeIdToJson,
  errorFromBody,
  type JsonObject,
  type JsonValue,
  type McpGrant,
  type NativeCloseRequest,
  type NativeSeedRequest,
  type EpisodeRequest,
  type ToolAccess,
  UpstreamError,
  withRolloutPrefix,
} from '@ckpt-gym/core/protocol';
import { type Boundary, type Logger, type StepMode } from '@ckpt-gym/core/server';
import type { Got, Response } from 'got';

import {
  type CleanupHandle,
  type EnvironmentProtocol,
  type EpisodeWork,
  type FailureStage,
  HandledEpisodeError,
  stageFailure,
} from './protocol.js';

export type ToolTransport = 'direct_http' | 'mcp';
export type Stage = 'seed' | 'invoke_agent' | 'close_agent' | 'verify' | 'return';
const STAGES: readonly Stage[] = ['seed', 'invoke_agent', 'close_agent', 'verify', 'return'];

export type Cookies = Record<string, string>;

/** The sessions an episode holds; they travel in every boundary. Replaced, never mutated. */
export interface SessionHandles {
  readonly resources_session_id: string;
  readonly resources_cookies: Cookies;
  readonly agent_session_id: string;
  readonly agent_cookies: Cookies;
  /** The verify step mode the resources server reported on its seed reply. */
  readonly resources_verify: StepMode;
}

export interface SingleAgentTurnOptions {
  /** Base URLs of the agent and resources servers. */
  agentUrl: string;
  resourcesUrl: string;
  /** The resources server's name (names the direct HTTP tool access). */
  resourcesName: string;
  /** The data-plane client. */
  client: Got;
  checkpointing: boolean;
  /** How the agent reaches the resources server's tools; default direct HTTP. */
  toolTransports?: readonly ToolTransport[];
  logger?: Pick<Logger, 'warn'>;
}

// --- pure helpers ---------------------------------------------------------------------------

export function newHandles(): SessionHandles {
  return {
    resources_session_id: `resources-session-${randomUUID().replaceAll('-', '')}`,
    resources_cookies: {},
    agent_session_id: `agent-session-${randomUUID().replaceAll('-', '')}`,
    agent_cookies: {},
    resources_verify: 'wait',
  };
}

function isObject(value: unknown): value is JsonObject {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function cookiesFrom(value: unknown): Cookies {
  const out: Cookies = {};
  if (!isObject(value)) return out;
  for (const [name, v] of Object.entries(value)) if (typeof v === 'string') out[name] = v;
  return out;
}

/** Handles from a restored boundary, or null when the boundary carries none. */
export function handlesFromJson(value: unknown): SessionHandles | null {
  if (!isObject(value)) return null;
  const rid = value.resources_session_id;
  const aid = value.agent_session_id;
  if (typeof rid !== 'string' || typeof aid !== 'string') return null;
  return {
    resources_session_id: rid,
    resources_cookies: cookiesFrom(value.resources_cookies),
    agent_session_id: aid,
    agent_cookies: cookiesFrom(value.agent_cookies),
    resources_verify: value.resources_verify === 'replay' ? 'replay' : 'wait',
  };
}

function handlesJson(handles: SessionHandles): JsonObject {
  return {
    resources_session_id: handles.resources_session_id,
    resources_cookies: { ...handles.resources_cookies },
    agent_session_id: handles.agent_session_id,
    agent_cookies: { ...handles.agent_cookies },
    resources_verify: handles.resources_verify,
  };
}

/** The verify mode a seed reply reports: `replay` only when the header says so. */
export function verifyModeFromHeader(value: string | string[] | undefined): StepMode {
  return value === 'replay' ? 'replay' : 'wait';
}

function headerIs(value: string | string[] | undefined, expected: string): boolean {
  return value === expected;
}

/** Name → value of every `Set-Cookie` of a reply. */
export function replyCookies(setCookie: string[] | undefined): Cookies {
  const out: Cookies = {};
  for (const line of setCookie ?? []) {
    const pair = line.split(';', 1)[0] ?? '';
    const eq = pair.indexOf('=');
    if (eq > 0) out[pair.slice(0, eq).trim()] = pair.slice(eq + 1).trim();
  }
  return out;
}

export function cookieHeader(cookies: Cookies): string | undefined {
  const parts = Object.entries(cookies).map(([name, value]) => `${name}=${value}`);
  return parts.length > 0 ? parts.join('; ') : undefined;
}

/** The flat `/verify` body: the task data with the create params and the agent's response. */
export function verifyBody(taskInput: JsonObject, response: JsonValue): JsonObject {
  const taskData = isObject(taskInput.task_data) ? taskInput.task_data : {};
  return {
    ...taskData,
    responses_create_params: taskInput.responses_create_params ?? {},
    response,
  };
}

// --- downstream calls ---------------------------------------------------------------------------

interface Reply {
  body: JsonValue;
  headers: Response['headers'];
  cookies: Cookies;
}

class BadReplyError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'BadReplyError';
  }
}

interface AgentCloseReply {
  observations: JsonValue;
  resourcesCookies: Cookies | null;
}

/** What a run carries from stage to stage; a restored boundary starts it at its recorded stage. */
interface TurnState {
  stage: Stage;
  /** Replaced, never mutated: a boundary builder may read the handles of an earlier snapshot. */
  handles: SessionHandles;
  response: JsonValue;
  observations: JsonValue;
  result: JsonObject | null;
}

/** One episode's run: its state, and the cleanups that close the sessions it opened. */
interface Turn {
  readonly request: EpisodeRequest;
  readonly work: EpisodeWork;
  readonly state: TurnState;
  readonly resourcesCleanup: CleanupHandle;
  agentCleanup: CleanupHandle | null;
  /** The agent's close reply, once a close succeeded. */
  agentClose: AgentCloseReply | null;
}

function stateFromBoundary(continuation: Boundary): TurnState {
  const next = continuation.next;
  return {
    stage: STAGES.includes(next as Stage) ? (next as Stage) : 'seed',
    handles: handlesFromJson(continuation.handles) ?? newHandles(),
    response: continuation.response ?? null,
    observations: continuation.observations ?? null,
    result: isObject(continuation.result) ? continuation.result : null,
  };
}

/** The boundary a stage starts with: what that stage and the ones after it need. */
function boundaryOf(at: TurnState): Boundary {
  const base = { next: at.stage, handles: handlesJson(at.handles) };
  switch (at.stage) {
    case 'seed':
    case 'invoke_agent':
      return base;
    case 'close_agent':
      return { ...base, response: at.response };
    case 'verify':
      return { ...base, response: at.response, observations: at.observations };
    case 'return':
      return { ...base, result: at.result ?? {}, observations: at.observations };
  }
}

/** The object a reply carries, or an empty one (a reply for another session is then refused). */
function replyObject(reply: Reply): JsonObject {
  return isObject(reply.body) ? reply.body : {};
}

export class SingleAgentTurn implements EnvironmentProtocol {
  readonly checkpointBoundaries = true;
  private readonly transports: readonly ToolTransport[];

  /** The episode's POSTs, their constant options set once (got merges a call's options per call). */
  private readonly episodePost: Got;

  constructor(private readonly options: SingleAgentTurnOptions) {
    this.transports = options.toolTransports ?? ['direct_http'];
    this.episodePost = options.client.extend({
      method: 'POST',
      responseType: 'text',
      ...(options.checkpointing ? { retry: { limit: 0 } } : {}),
    });
  }

  /**
   * Forwarded unchanged to the resources server (not episode work: no rollout prefix). Its
   * refusal (a 4xx) is the client's, passed on as it is; an unreachable server or a reply that is
   * not JSON is a 502 `upstream_error`.
   */
  async aggregateMetrics(body: JsonObject, signal: AbortSignal): Promise<JsonValue> {
    const url = `${this.options.resourcesUrl.replace(/\/+$/, '')}/aggregate_metrics`;
    const response = await postUpstream(this.options.client, url, { json: body, signal });
    let reply: JsonValue | undefined;
    try {
      reply = decodeJson(response.body);
    } catch {
      reply = undefined;
    }
    if (response.statusCode < 200 || response.statusCode >= 300) {
      throw errorFromBody(response.statusCode, reply);
    }
    if (reply === undefined) throw new UpstreamError(`${url} replied with a body that is not JSON`);
    return reply;
  }

  /** POSTs a JSON body under the episode's rollout prefix; never re-sent with checkpointing on. */
  private async post(
    base: string,
    key: string,
    path: string,
    body: unknown,
    opts: { cookies?: Cookies; headers?: Record<string, string>; signal: AbortSignal },
  ): Promise<Reply> {
    const headers: Record<string, string> = {
      'content-type': 'application/json',
      ...opts.headers,
    };
    const cookie = cookieHeader(opts.cookies ?? {});
    if (cookie !== undefined) headers.cookie = cookie;
    const url = withRolloutPrefix(base, key, path);
    const response = await this.episodePost(url, {
      body: encodeJson(body),
      headers,
      signal: opts.signal,
    }).catch((err: unknown) => {
      logTimedOutCall(url, err, opts.signal);
      throw err;
    });
    let parsed: JsonValue;
    try {
      parsed = response.body === '' ? null : decodeJson(response.body);
    } catch (err) {
      throw new BadReplyError(`${path} replied with invalid JSON: ${(err as Error).message}`);
    }
    return {
      body: parsed,
      headers: response.headers,
      cookies: replyCookies(response.headers['set-cookie']),
    };
  }

  /** Runs `call`; its failure fails the episode at `stage`, unless the episode was aborted. */
  private async failingAs<T>(
    turn: Turn,
    stage: FailureStage,
    what: string,
    call: () => Promise<T>,
    extra?: Record<string, JsonValue>,
  ): Promise<T> {
    try {
      return await call();
    } catch (err) {
      if (turn.work.signal.aborted) throw err;
      throw stageFailure(stage, what, err, extra);
    }
  }

  async run(request: EpisodeRequest, work: EpisodeWork): Promise<JsonObject> {
    const turn = this.begin(request, work);
    if (turn.state.stage === 'seed') await this.seedStage(turn);
    if (turn.state.stage === 'invoke_agent') await this.invokeStage(turn);
    if (turn.state.stage === 'close_agent') await this.closeStage(turn);
    if (turn.state.stage === 'verify') await this.verifyStage(turn);
    const at = await this.enter(turn);
    return { ...(at.result ?? {}), ng_agent_observations: at.observations };
  }

  /** The run's state at its continuation, with the cleanups of the sessions it may hold. */
  private begin(request: EpisodeRequest, work: EpisodeWork): Turn {
    const state = stateFromBoundary(work.continuation() ?? {});
    // First, so a lost seed reply cannot hide the caller-assigned session id.
    const resourcesCleanup = work.cleanup.push('resources session', (signal) => {
      const close: NativeCloseRequest = {
        resources_session_id: state.handles.resources_session_id,
        episode_id: episodeIdToJson(work.episode),
      };
      return this.post(this.options.resourcesUrl, work.key, '/close_session', close, {
        cookies: state.handles.resources_cookies,
        signal,
      }).then(() => undefined);
    });
    const turn: Turn = {
      request,
      work,
      state,
      resourcesCleanup,
      agentCleanup: null,
      agentClose: null,
    };
    if (state.stage === 'invoke_agent' || state.stage === 'close_agent') {
      turn.agentCleanup = this.registerAgentCleanup(turn);
    }
    return turn;
  }

  /** Pushes the agent session's close, which keeps the agent's reply in `turn.agentClose`. */
  private registerAgentCleanup(turn: Turn): CleanupHandle {
    const { work, state } = turn;
    return work.cleanup.push('agent session', async (signal) => {
      const close: AgentCloseRequest = {
        agent_session_id: state.handles.agent_session_id,
        episode_id: episodeIdToJson(work.episode),
      };
      const reply = await this.post(
        this.options.agentUrl,
        work.key,
        '/v1/agent_sessions/close',
        close,
        { cookies: state.handles.agent_cookies, signal },
      );
      const body = replyObject(reply);
      if (body.agent_session_id !== state.handles.agent_session_id) {
        throw new BadReplyError('agent close replied for another agent_session_id');
      }
      turn.agentClose = {
        observations: body.agent_observations ?? null,
        resourcesCookies: isObject(body.resources_cookies)
          ? cookiesFrom(body.resources_cookies)
          : null,
      };
    });
  }

  /**
   * Records the boundary the current stage starts with (a checkpoint parks the episode here) and
   * returns the state it records: a builder runs later, so it reads this snapshot, never the state.
   */
  private async enter(turn: Turn): Promise<TurnState> {
    const at = { ...turn.state };
    await turn.work.boundary(() => boundaryOf(at));
    return at;
  }

  private async seedStage(turn: Turn): Promise<void> {
    const at = await this.enter(turn);
    // An episode that grants MCP access is a restart from its first seed: a checkpoint taken while
    // it seeds must not export it, since a replayed seed mints a new MCP token, and the agent
    // session seeded with the old one would refuse the new seed as another seed request.
    if (this.transports.includes('mcp')) await turn.work.markRestart();
    await turn.work.step('replay', () => this.seed(turn, at.handles));
    turn.state.stage = 'invoke_agent';
  }

  private async invokeStage(turn: Turn): Promise<void> {
    const at = await this.enter(turn);
    try {
      const activated = await turn.work.step('replay', () => this.activate(turn, at.handles));
      turn.state.response = activated.response;
      turn.state.handles = activated.handles;
    } catch (err) {
      if (turn.work.signal.aborted || !(err instanceof HandledEpisodeError)) throw err;
      throw await this.failedActivation(turn, err);
    }
    turn.state.stage = 'close_agent';
  }

  /**
   * A failed activation keeps the agent's observations: its session is closed now (the failed
   * replay step has already waited for resume if a checkpoint was open).
   */
  private async failedActivation(
    turn: Turn,
    err: HandledEpisodeError,
  ): Promise<HandledEpisodeError> {
    const failure = { ...err.failure };
    try {
      await turn.agentCleanup?.close();
      failure.ng_agent_observations = turn.agentClose?.observations ?? null;
    } catch (closeErr) {
      this.options.logger?.warn('closing the agent session after a failed activation failed', {
        episode: turn.work.key,
        error: closeErr instanceof Error ? closeErr.message : String(closeErr),
      });
    }
    return new HandledEpisodeError(failure, { cause: err });
  }

  private async closeStage(turn: Turn): Promise<void> {
    const at = await this.enter(turn);
    const closing = turn.agentCleanup ?? this.registerAgentCleanup(turn);
    await this.failingAs(
      turn,
      'cleanup',
      'Closing the agent session',
      () => turn.work.step('wait', () => closing.close(turn.work.signal)),
      { partial_response: at.response },
    );
    const closed = turn.agentClose;
    turn.state.observations = closed?.observations ?? null;
    if (closed?.resourcesCookies) {
      turn.state.handles = { ...turn.state.handles, resources_cookies: closed.resourcesCookies };
    }
    turn.state.stage = 'verify';
  }

  private async verifyStage(turn: Turn): Promise<void> {
    const at = await this.enter(turn);
    const mode = at.handles.resources_verify;
    turn.state.result = await this.failingAs(
      turn,
      'verification',
      'Verification',
      () => turn.work.step(mode, () => this.verify(turn, at, mode)),
      { partial_response: at.response },
    );
    // One more bounded close that cannot erase the verdict.
    turn.work.cleanup.push('post-verification resources session', (signal) =>
      turn.resourcesCleanup.close(signal),
    );
    turn.state.stage = 'return';
  }

  private async verify(turn: Turn, at: TurnState, mode: StepMode): Promise<JsonObject> {
    const reply = await this.post(
      this.options.resourcesUrl,
      turn.work.key,
      '/verify',
      verifyBody(turn.request.task.task_input, at.response),
      {
        cookies: at.handles.resources_cookies,
        // The resources session stays exported until the close this episode sends.
        ...(mode === 'replay' ? { headers: { [CHECKPOINT_CLOSE_FOLLOWS_HEADER]: '1' } } : {}),
        signal: turn.work.signal,
      },
    );
    if (!isObject(reply.body)) throw new BadReplyError('/verify did not reply with an object');
    return reply.body;
  }

  /**
   * Seeds the resources session, then the agent session with its tool accesses. The handles are
   * kept as they arrive, so cleanup closes whatever a failed seed established.
   */
  private async seed(turn: Turn, start: SessionHandles): Promise<void> {
    const resources = await this.failingAs(turn, 'seed', 'Seeding the resources session', () =>
      this.seedResources(turn, start),
    );
    turn.state.handles = resources.handles;
    const accesses = this.toolAccesses(turn, resources.handles, resources.tools);
    turn.agentCleanup = this.registerAgentCleanup(turn);
    const seed: AgentSeedRequest = {
      agent_session_id: resources.handles.agent_session_id,
      episode_id: episodeIdToJson(turn.work.episode),
      task_id: { ...turn.request.task.task_id },
      tool_accesses: accesses,
      // Forwarded as the resources server sent it: the agent's seed check refuses a bad one.
      sandbox_access: resources.sandboxAccess as JsonObject | null,
    };
    const agent = await this.failingAs(turn, 'agent', 'Seeding the agent session', () =>
      this.seedAgent(turn, seed),
    );
    turn.state.handles = { ...resources.handles, agent_cookies: agent.cookies };
    if (resources.restart || agent.restart) await turn.work.markRestart();
  }

  private async seedResources(turn: Turn, start: SessionHandles) {
    const { request, work } = turn;
    const taskInput = request.task.task_input;
    const seed: NativeSeedRequest = {
      resources_session_id: start.resources_session_id,
      episode_id: episodeIdToJson(work.episode),
      task_id: { ...request.task.task_id },
      task_data: isObject(taskInput.task_data) ? taskInput.task_data : {},
    };
    const reply = await this.post(this.options.resourcesUrl, work.key, '/seed_session', seed, {
      signal: work.signal,
    });
    if (Object.keys(reply.cookies).length === 0) {
      throw new BadReplyError('Resources seed did not establish a session cookie');
    }
    const body = replyObject(reply);
    if (body.resources_session_id !== start.resources_session_id) {
      throw new BadReplyError('Resources seed replied for another resources_session_id');
    }
    return {
      handles: {
        ...start,
        resources_cookies: reply.cookies,
        resources_verify: verifyModeFromHeader(reply.headers[CHECKPOINT_VERIFY_HEADER]),
      },
      sandboxAccess: body.sandbox_access ?? null,
      tools: body.resources_tools ?? null,
      restart: headerIs(reply.headers[CHECKPOINT_RESTART_HEADER], '1'),
    };
  }

  /** The agent's tool grants, one per transport (MCP ones make the episode a restart: `seedStage`). */
  private toolAccesses(
    turn: Turn,
    handles: SessionHandles,
    resourcesTools: JsonValue,
  ): ToolAccess[] {
    const { resourcesUrl, resourcesName, checkpointing } = this.options;
    const accesses: ToolAccess[] = [];
    for (const transport of this.transports) {
      if (transport === 'direct_http') {
        const grant: DirectHttpGrant = {
          kind: 'direct_http',
          name: `${resourcesName}.direct_http`,
          required: true,
          // With checkpointing on, tool calls name the attempt that seeded the session.
          base_url: checkpointing ? withRolloutPrefix(resourcesUrl, turn.work.key) : resourcesUrl,
          cookies: { ...handles.resources_cookies },
        };
        accesses.push(grant);
      } else {
        accesses.push(mcpAccess(resourcesTools, resourcesUrl));
      }
    }
    return accesses;
  }

  private async seedAgent(turn: Turn, seed: AgentSeedRequest) {
    const reply = await this.post(
      this.options.agentUrl,
      turn.work.key,
      '/v1/agent_sessions',
      seed,
      {
        signal: turn.work.signal,
      },
    );
    if (replyObject(reply).agent_session_id !== seed.agent_session_id) {
      throw new BadReplyError('Agent seed replied for another agent_session_id');
    }
    return {
      cookies: reply.cookies,
      restart: headerIs(reply.headers[CHECKPOINT_RESTART_HEADER], '1'),
    };
  }

  /** The single agent activation (index 1) under the episode's prefix. */
  private activate(
    turn: Turn,
    handles: SessionHandles,
  ): Promise<{ response: JsonValue; handles: SessionHandles }> {
    return this.failingAs(turn, 'agent', 'The agent activation', async () => {
      const reply = await this.post(
        this.options.agentUrl,
        turn.work.key,
        '/v1/responses',
        turn.request.task.task_input.responses_create_params ?? {},
        { cookies: handles.agent_cookies, headers: activationHeader(1), signal: turn.work.signal },
      );
      if (!isObject(reply.body))
        throw new BadReplyError('/v1/responses did not reply with an object');
      const cookies = Object.keys(reply.cookies).length > 0 ? reply.cookies : handles.agent_cookies;
      return { response: reply.body, handles: { ...handles, agent_cookies: cookies } };
    });
  }
}

/** The MCP tool access a seed reply's `resources_tools` describes; anything else is terminal. */
function mcpAccess(resourcesTools: JsonValue, resourcesUrl: string): McpGrant {
  if (!isObject(resourcesTools)) {
    throw new HandledEpisodeError({
      failure_reason:
        'MCP tool transport requested but the resources seed reported no resources_tools',
      terminal: true,
      stage: 'seed',
    });
  }
  if (resourcesTools.transport !== 'http') {
    throw new HandledEpisodeError({
      failure_reason: `MCP tool transport ${JSON.stringify(resourcesTools.transport)} is not supported (only "http")`,
      terminal: true,
      stage: 'seed',
    });
  }
  const path = typeof resourcesTools.url_path === 'string' ? resourcesTools.url_path : '/mcp';
  return {
    kind: 'mcp',
    name: typeof resourcesTools.server_name === 'string' ? resourcesTools.server_name : 'resources',
    required: true,
    connection: {
      transport: 'streamable_http',
      url: `${resourcesUrl.replace(/\/+$/, '')}/${path.replace(/^\/+/, '')}`,
      headers: isObject(resourcesTools.headers) ? resourcesTools.headers : {},
    },
  };
}
