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

import {
  AGENT_ACTIVATION_HEADER,
  type Boundary,
  CHECKPOINT_CLOSE_FOLLOWS_HEADER,
  CHECKPOINT_RESTART_HEADER,
  CHECKPOINT_VERIFY_HEADER,
  decodeJson,
  encodeJson,
  episodeIdToJson,
  errorFromBody,
  type JsonObject,
  type JsonValue,
  type Logger,
  postUpstream,
  type StepMode,
  UpstreamError,
  withRolloutPrefix,
} from '@ckpt-gym/core';
import type { Got, Response } from 'got';

import {
  type CleanupHandle,
  type EnvironmentProtocol,
  type EpisodeRequest,
  type EpisodeWork,
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

export class SingleAgentTurn implements EnvironmentProtocol {
  readonly checkpointBoundaries = true;
  private readonly transports: readonly ToolTransport[];

  constructor(private readonly options: SingleAgentTurnOptions) {
    this.transports = options.toolTransports ?? ['direct_http'];
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

  /** POSTs JSON under the episode's rollout prefix; never re-sent with checkpointing on. */
  private async post(
    base: string,
    key: string,
    path: string,
    body: JsonValue,
    opts: { cookies?: Cookies; headers?: Record<string, string>; signal: AbortSignal },
  ): Promise<Reply> {
    const headers: Record<string, string> = {
      'content-type': 'application/json',
      ...opts.headers,
    };
    const cookie = cookieHeader(opts.cookies ?? {});
    if (cookie !== undefined) headers.cookie = cookie;
    const response = await this.options.client.post(withRolloutPrefix(base, key, path), {
      body: encodeJson(body),
      headers,
      signal: opts.signal,
      responseType: 'text',
      ...(this.options.checkpointing ? { retry: { limit: 0 } } : {}),
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

  async run(request: EpisodeRequest, work: EpisodeWork): Promise<JsonObject> {
    const continuation: Boundary = work.continuation() ?? {};
    const next = continuation.next;
    let stage: Stage = STAGES.includes(next as Stage) ? (next as Stage) : 'seed';
    let handles = handlesFromJson(continuation.handles) ?? newHandles();
    let response: JsonValue = continuation.response ?? null;
    let observations: JsonValue = continuation.observations ?? null;
    let result: JsonObject | null = isObject(continuation.result) ? continuation.result : null;
    const key = work.key;
    const { agentUrl, resourcesUrl } = this.options;

    // First, so a lost seed reply cannot hide the caller-assigned session id.
    const resourcesCleanup = work.cleanup.push('resources session', (signal) =>
      this.post(
        resourcesUrl,
        key,
        '/close_session',
        {
          resources_session_id: handles.resources_session_id,
          episode_id: episodeIdToJson(work.episode),
        },
        { cookies: handles.resources_cookies, signal },
      ).then(() => undefined),
    );
    let agentClose: AgentCloseReply | null = null;
    const registerAgentCleanup = (): CleanupHandle =>
      work.cleanup.push('agent session', async (signal) => {
        const reply = await this.post(
          agentUrl,
          key,
          '/v1/agent_sessions/close',
          { agent_session_id: handles.agent_session_id, episode_id: episodeIdToJson(work.episode) },
          { cookies: handles.agent_cookies, signal },
        );
        const body = isObject(reply.body) ? reply.body : {};
        if (body.agent_session_id !== handles.agent_session_id) {
          throw new BadReplyError('agent close replied for another agent_session_id');
        }
        agentClose = {
          observations: body.agent_observations ?? null,
          resourcesCookies: isObject(body.resources_cookies)
            ? cookiesFrom(body.resources_cookies)
            : null,
        };
      });
    let agentCleanup: CleanupHandle | null =
      stage === 'invoke_agent' || stage === 'close_agent' ? registerAgentCleanup() : null;

    if (stage === 'seed') {
      const seedHandles = handles;
      await work.boundary(() => ({ next: 'seed', handles: handlesJson(seedHandles) }));
      await work.step('replay', () =>
        this.seed(request, work, seedHandles, {
          // Kept as they arrive, so cleanup closes whatever a failed seed established.
          update: (seeded) => {
            handles = seeded;
          },
          agentCleanupDue: () => {
            agentCleanup = registerAgentCleanup();
          },
        }),
      );
      stage = 'invoke_agent';
    }

    if (stage === 'invoke_agent') {
      const invokeHandles = handles;
      await work.boundary(() => ({ next: 'invoke_agent', handles: handlesJson(invokeHandles) }));
      try {
        const activated = await work.step('replay', () =>
          this.activate(request, work, invokeHandles),
        );
        response = activated.response;
        handles = activated.handles;
      } catch (err) {
        if (work.signal.aborted || !(err instanceof HandledEpisodeError)) throw err;
        // Keep the agent's observations: close its session now (the failed replay step has
        // already waited for resume if a checkpoint was open).
        const failure = { ...err.failure };
        try {
          await agentCleanup?.close();
          failure.ng_agent_observations =
            (agentClose as AgentCloseReply | null)?.observations ?? null;
        } catch (closeErr) {
          this.options.logger?.warn('closing the agent session after a failed activation failed', {
            episode: key,
            error: closeErr instanceof Error ? closeErr.message : String(closeErr),
          });
        }
        throw new HandledEpisodeError(failure, { cause: err });
      }
      stage = 'close_agent';
    }

    if (stage === 'close_agent') {
      const closeHandles = handles;
      const closeResponse = response;
      await work.boundary(() => ({
        next: 'close_agent',
        handles: handlesJson(closeHandles),
        response: closeResponse,
      }));
      const closing = agentCleanup ?? registerAgentCleanup();
      try {
        await work.step('wait', () => closing.close(work.signal));
      } catch (err) {
        if (work.signal.aborted) throw err;
        throw stageFailure('cleanup', 'Closing the agent session', err, {
          partial_response: closeResponse,
        });
      }
      const closed = agentClose as AgentCloseReply | null;
      observations = closed?.observations ?? null;
      if (closed?.resourcesCookies) {
        handles = { ...handles, resources_cookies: closed.resourcesCookies };
      }
      stage = 'verify';
    }

    if (stage === 'verify') {
      const verifyHandles = handles;
      const verifyResponse = response;
      const verifyObservations = observations;
      await work.boundary(() => ({
        next: 'verify',
        handles: handlesJson(verifyHandles),
        response: verifyResponse,
        observations: verifyObservations,
      }));
      const mode = verifyHandles.resources_verify;
      try {
        result = await work.step(mode, async () => {
          const reply = await this.post(
            resourcesUrl,
            key,
            '/verify',
            verifyBody(request.task.task_input, verifyResponse),
            {
              cookies: verifyHandles.resources_cookies,
              // The resources session stays exported until the close this episode sends.
              ...(mode === 'replay' ? { headers: { [CHECKPOINT_CLOSE_FOLLOWS_HEADER]: '1' } } : {}),
              signal: work.signal,
            },
          );
          if (!isObject(reply.body))
            throw new BadReplyError('/verify did not reply with an object');
          return reply.body;
        });
      } catch (err) {
        if (work.signal.aborted) throw err;
        throw stageFailure('verification', 'Verification', err, {
          partial_response: verifyResponse,
        });
      }
      // One more bounded close that cannot erase the verdict.
      work.cleanup.push('post-verification resources session', (signal) =>
        resourcesCleanup.close(signal),
      );
      stage = 'return';
    }

    const returnHandles = handles;
    const returnResult = result ?? {};
    const returnObservations = observations;
    await work.boundary(() => ({
      next: 'return',
      handles: handlesJson(returnHandles),
      result: returnResult,
      observations: returnObservations,
    }));
    return { ...returnResult, ng_agent_observations: returnObservations };
  }

  /** Seeds the resources session, then the agent session with its tool accesses. */
  private async seed(
    request: EpisodeRequest,
    work: EpisodeWork,
    start: SessionHandles,
    hooks: { update: (handles: SessionHandles) => void; agentCleanupDue: () => void },
  ): Promise<void> {
    const { agentUrl, resourcesUrl, resourcesName } = this.options;
    const episode = episodeIdToJson(work.episode);
    const taskId = { ...request.task.task_id };
    const taskInput = request.task.task_input;
    let handles = start;
    let restart = false;
    let sandboxAccess: JsonValue = null;
    let resourcesTools: JsonValue = null;
    try {
      const reply = await this.post(
        resourcesUrl,
        work.key,
        '/seed_session',
        {
          resources_session_id: handles.resources_session_id,
          episode_id: episode,
          task_id: taskId,
          task_data: isObject(taskInput.task_data) ? taskInput.task_data : {},
        },
        { signal: work.signal },
      );
      if (Object.keys(reply.cookies).length === 0) {
        throw new BadReplyError('Resources seed did not establish a session cookie');
      }
      const body = isObject(reply.body) ? reply.body : {};
      if (body.resources_session_id !== handles.resources_session_id) {
        throw new BadReplyError('Resources seed replied for another resources_session_id');
      }
      sandboxAccess = body.sandbox_access ?? null;
      resourcesTools = body.resources_tools ?? null;
      handles = {
        ...handles,
        resources_cookies: reply.cookies,
        resources_verify: verifyModeFromHeader(reply.headers[CHECKPOINT_VERIFY_HEADER]),
      };
      hooks.update(handles);
      restart ||= headerIs(reply.headers[CHECKPOINT_RESTART_HEADER], '1');
    } catch (err) {
      if (work.signal.aborted) throw err;
      throw stageFailure('seed', 'Seeding the resources session', err);
    }

    const toolAccesses: JsonValue[] = [];
    for (const transport of this.transports) {
      if (transport === 'direct_http') {
        toolAccesses.push({
          kind: 'direct_http',
          name: `${resourcesName}.direct_http`,
          required: true,
          // With checkpointing on, tool calls name the attempt that seeded the session.
          base_url: this.options.checkpointing
            ? withRolloutPrefix(resourcesUrl, work.key)
            : resourcesUrl,
          cookies: { ...handles.resources_cookies },
        });
      } else {
        toolAccesses.push(mcpAccess(resourcesTools, resourcesUrl));
        // MCP tool calls cannot be captured: the episode starts over after a crash.
        restart = true;
      }
    }

    hooks.agentCleanupDue();
    try {
      const reply = await this.post(
        agentUrl,
        work.key,
        '/v1/agent_sessions',
        {
          agent_session_id: handles.agent_session_id,
          episode_id: episode,
          task_id: taskId,
          tool_accesses: toolAccesses,
          sandbox_access: sandboxAccess,
        },
        { signal: work.signal },
      );
      const body = isObject(reply.body) ? reply.body : {};
      if (body.agent_session_id !== handles.agent_session_id) {
        throw new BadReplyError('Agent seed replied for another agent_session_id');
      }
      handles = { ...handles, agent_cookies: reply.cookies };
      hooks.update(handles);
      restart ||= headerIs(reply.headers[CHECKPOINT_RESTART_HEADER], '1');
    } catch (err) {
      if (work.signal.aborted) throw err;
      throw stageFailure('agent', 'Seeding the agent session', err);
    }
    if (restart) await work.markRestart();
  }

  /** The single agent activation (index 1) under the episode's prefix. */
  private async activate(
    request: EpisodeRequest,
    work: EpisodeWork,
    handles: SessionHandles,
  ): Promise<{ response: JsonValue; handles: SessionHandles }> {
    try {
      const reply = await this.post(
        this.options.agentUrl,
        work.key,
        '/v1/responses',
        request.task.task_input.responses_create_params ?? {},
        {
          cookies: handles.agent_cookies,
          headers: { [AGENT_ACTIVATION_HEADER]: '1' },
          signal: work.signal,
        },
      );
      if (!isObject(reply.body))
        throw new BadReplyError('/v1/responses did not reply with an object');
      const cookies = Object.keys(reply.cookies).length > 0 ? reply.cookies : handles.agent_cookies;
      return { response: reply.body, handles: { ...handles, agent_cookies: cookies } };
    } catch (err) {
      if (work.signal.aborted) throw err;
      throw stageFailure('agent', 'The agent activation', err);
    }
  }
}

/** The MCP tool access a seed reply's `resources_tools` describes; anything else is terminal. */
function mcpAccess(resourcesTools: JsonValue, resourcesUrl: string): JsonObject {
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
