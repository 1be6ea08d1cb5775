/**
 * Simple Agent: the model ↔ tools turn loop. Each turn resends the whole conversation to the policy
 * model under the activation's rollout prefix, runs the function calls it asks for against the
 * session's direct HTTP tool access under the same prefix (or, with `tool_transport: mcp`, over
 * its MCP grant: see `mcp-tools.ts`), and stops at the first answer without function calls (or at
 * `max_steps` model calls). Boundaries are recorded before each model call
 * and after each tool round, as builders: nothing is copied unless a checkpoint exports it.
 */
import { postUpstream } from '@ckpt-gym/core/client';
import {
  type AgentSeedRequest,
  CheckpointError,
  type DirectHttpToolAccess,
  type EpisodeId,
  errorFromBody,
  InvalidRequestError,
  type JsonObject,
  type JsonValue,
  type McpToolAccess,
  parseDirectHttpGrant,
  parseMcpGrant,
  UpstreamError,
  withRolloutPrefix,
} from '@ckpt-gym/core/protocol';
import { appendEncoded, appendOnly, encodeOnce } from '@ckpt-gym/core/server';
import type { Got } from 'got';

import type {
  Agent,
  AgentCloseResult,
  AgentContext,
  AgentReply,
  Invocation,
  LegacyRunRequest,
} from './agent.js';
import { type SimpleAgentConfig, simpleAgentConfig, type ToolTransport } from './config.js';
import { legacyRun } from './legacy-run.js';
import { McpTools, withMcpTools } from './mcp-tools.js';
import type { ActivationHandle, AgentSessionHooks, RestoredAgentSession } from './participant.js';
import {
  type AgentSessionEntry,
  type AgentSessionTable,
  mergeSetCookies,
  seedFingerprint,
  type StoredReply,
} from './sessions.js';

export interface SimpleSessionState {
  toolAccess: DirectHttpToolAccess | McpToolAccess | null;
  /** The resources cookie jar; null when the session holds no direct tool grant. */
  resourcesCookies: Record<string, string> | null;
  /** One trajectory per completed activation, reported at close. */
  observations: JsonObject[];
}

/** The loop state at a boundary (what a checkpoint stores and a restore continues from). */
export interface LoopState {
  step: number;
  pending_tools: boolean;
  new_outputs: JsonObject[];
  usage: JsonObject | null;
  last_model_response: JsonObject | null;
  model_server_cookies: Record<string, string>;
  resources_server_cookies: Record<string, string> | null;
  /** How many of `new_outputs` each model call's question held (the questions themselves are rebuilt). */
  question_outputs: number[];
}

const LOOP_STATE_KEYS = [
  'step',
  'pending_tools',
  'new_outputs',
  'usage',
  'last_model_response',
  'model_server_cookies',
  'resources_server_cookies',
  'question_outputs',
];

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

/** Validates a restored boundary; extra or missing fields are `invalid_checkpoint_state`-worthy. */
export function parseLoopState(value: JsonObject): LoopState {
  const keys = Object.keys(value);
  const bad = keys.filter((k) => !LOOP_STATE_KEYS.includes(k));
  const missing = LOOP_STATE_KEYS.filter((k) => !keys.includes(k));
  if (bad.length > 0 || missing.length > 0 || !Array.isArray(value.new_outputs)) {
    throw new CheckpointError(
      `restored Simple Agent boundary is malformed (unknown: ${bad.join(', ') || '-'}; missing: ${missing.join(', ') || '-'})`,
    );
  }
  return value as unknown as LoopState;
}

/** The request's input as a list of items (a string becomes one user message). */
export function inputItems(input: unknown): JsonObject[] {
  if (typeof input === 'string') return [{ role: 'user', content: input, type: 'message' }];
  if (Array.isArray(input) && input.every(isObject)) return input as JsonObject[];
  throw new InvalidRequestError('input: must be a string or a list of item objects');
}

/** Rebuilds each turn's question from the request's input and the loop's outputs. */
export function rebuildQuestions(
  input: JsonObject[],
  outputs: JsonObject[],
  questionOutputs: number[],
): JsonObject[][] {
  return questionOutputs.map((n) => [...input, ...outputs.slice(0, n)]);
}

/** `base` without a trailing `/ng-rollout/<key>` (the grant's), under `episode`'s prefix instead. */
export function toolBaseUrl(baseUrl: string, episode: EpisodeId | undefined): string {
  const bare = baseUrl.replace(/\/+$/, '').replace(/\/ng-rollout\/[^/]+$/, '');
  return episode ? withRolloutPrefix(bare, episode) : bare;
}

function cookieHeader(jar: Record<string, string> | null): string | undefined {
  if (!jar || Object.keys(jar).length === 0) return undefined;
  return Object.entries(jar)
    .map(([k, v]) => `${k}=${v}`)
    .join('; ');
}

function addUsage(total: JsonObject | null, usage: unknown): JsonObject | null {
  if (!isObject(usage)) return total;
  if (!total) return structuredClone(usage) as JsonObject;
  const out: JsonObject = { ...total };
  for (const key of ['input_tokens', 'output_tokens', 'total_tokens']) {
    const a = total[key];
    const b = usage[key];
    if (typeof a === 'number' && typeof b === 'number') out[key] = a + b;
  }
  return out;
}

/** Where the loop's function calls go: a direct HTTP base URL, or an activation's MCP connection. */
type ToolTarget = { baseUrl: string; headers: Record<string, string> } | { mcp: McpTools };

export interface LoopResult {
  response: JsonObject;
  state: LoopState;
  trajectory: JsonObject;
}

/**
 * A builder of the loop's state at a boundary. Lists only grow, so a builder that pins their
 * lengths now still yields this boundary's state when it is called later.
 */
function boundaryState(st: LoopState): () => JsonObject {
  const pinned = {
    step: st.step,
    pending_tools: st.pending_tools,
    outputs: st.new_outputs.length,
    usage: st.usage,
    last_model_response: st.last_model_response,
    model_server_cookies: st.model_server_cookies,
    resources_server_cookies: st.resources_server_cookies,
    questions: st.question_outputs.length,
  };
  return () => ({
    step: pinned.step,
    pending_tools: pinned.pending_tools,
    new_outputs: st.new_outputs.slice(0, pinned.outputs),
    usage: pinned.usage,
    last_model_response: pinned.last_model_response,
    model_server_cookies: pinned.model_server_cookies,
    resources_server_cookies: pinned.resources_server_cookies,
    question_outputs: st.question_outputs.slice(0, pinned.questions),
  });
}

export interface TurnLoopParts {
  http: Got;
  config: SimpleAgentConfig;
  body: JsonObject;
  episode: EpisodeId | undefined;
  handle: ActivationHandle;
  invocationId: string;
  tools: ToolTarget | null;
  jar: Record<string, string> | null;
  modelCookies: Record<string, string>;
}

/** One model call of the loop, its answer folded into the loop's state; returns the answer. */
async function askModel(
  { http, config, body, episode, handle }: TurnLoopParts,
  st: LoopState,
  input: JsonObject[],
): Promise<JsonObject> {
  st.step += 1;
  const question = [...input, ...st.new_outputs];
  const reply = await handle.awaitingModel(() =>
    callModel(
      http,
      config.modelServerUrl,
      episode,
      { ...body, input: question },
      st.model_server_cookies,
      handle.signal,
    ),
  );
  st.question_outputs = [...st.question_outputs, st.new_outputs.length];
  st.model_server_cookies = mergeSetCookies(st.model_server_cookies, reply.setCookie) ?? {};
  const output = Array.isArray(reply.body.output) ? (reply.body.output as JsonObject[]) : [];
  st.new_outputs = [...st.new_outputs, ...output];
  st.usage = addUsage(st.usage, reply.body.usage);
  st.last_model_response = { ...reply.body, usage: null };
  return reply.body;
}

/**
 * The turn loop. `jar` is the resources cookie jar the tools see (null: none); the result's state
 * carries the jar after the loop.
 */
export async function runTurnLoop(parts: TurnLoopParts): Promise<LoopResult> {
  const { http, config, handle } = parts;
  const input = inputItems(parts.body.input);
  const restored = handle.continuation ? parseLoopState(handle.continuation) : null;
  const st: LoopState = restored ?? {
    step: 0,
    pending_tools: false,
    new_outputs: [],
    usage: null,
    last_model_response: null,
    model_server_cookies: { ...parts.modelCookies },
    resources_server_cookies: parts.jar,
    question_outputs: [],
  };
  const snapshot = () => boundaryState(st);
  let status: 'completed' | 'incomplete' = 'completed';
  let termination: JsonObject | null = null;

  while (true) {
    if (!st.pending_tools) {
      await handle.boundary(snapshot());
      const reply = await askModel(parts, st, input);
      const output = Array.isArray(reply.output) ? (reply.output as JsonObject[]) : [];
      if (isObject(reply.incomplete_details)) {
        status = 'incomplete';
        break;
      }
      const calls = output.filter((item) => item.type === 'function_call');
      if (calls.length === 0) {
        if (!output.some((item) => item.type === 'message')) {
          status = 'incomplete';
          termination = {
            ng_termination_reason: output.length > 0 ? 'incomplete_reasoning' : 'empty_output',
            ng_termination_message: 'the model ended its turn without a message or a function call',
          };
        }
        break;
      }
      st.pending_tools = true;
      await handle.boundary(snapshot());
    }
    const calls = ((st.last_model_response?.output ?? []) as JsonObject[]).filter(
      (item) => item.type === 'function_call',
    );
    for (const call of calls) {
      const out = await callTool(http, parts.tools, call, st, handle.signal);
      st.new_outputs = [
        ...st.new_outputs,
        { type: 'function_call_output', call_id: call.call_id ?? null, output: out },
      ];
    }
    st.pending_tools = false;
    if (config.maxSteps !== null && st.step >= config.maxSteps) {
      status = 'incomplete';
      termination = {
        ng_termination_reason: 'max_steps',
        ng_termination_message: `stopped after ${config.maxSteps} model calls`,
      };
      break;
    }
  }

  return loopResult(st, input, parts.invocationId, status, termination);
}

/** The loop's reply, with its final status and termination reason, and its trajectory. */
function loopResult(
  st: LoopState,
  input: JsonObject[],
  invocationId: string,
  status: 'completed' | 'incomplete',
  termination: JsonObject | null,
): LoopResult {
  const last = st.last_model_response ?? {};
  const response: JsonObject = { ...last, output: st.new_outputs, usage: st.usage };
  if (status === 'incomplete') response.status = 'incomplete';
  if (termination)
    response.metadata = {
      ...(isObject(last.metadata) ? (last.metadata as JsonObject) : {}),
      ...termination,
    };
  const trajectory: JsonObject = {
    invocation_id: invocationId,
    status,
    turns: rebuildQuestions(input, st.new_outputs, st.question_outputs).map((question) => ({
      question,
    })),
    output: st.new_outputs,
    usage: st.usage,
  };
  return { response, state: st, trajectory };
}

async function callModel(
  http: Got,
  baseUrl: string,
  episode: EpisodeId | undefined,
  body: JsonObject,
  cookies: Record<string, string>,
  signal: AbortSignal,
): Promise<{ body: JsonObject; setCookie: string[] | undefined }> {
  const url = episode
    ? withRolloutPrefix(baseUrl, episode, '/v1/responses')
    : `${baseUrl.replace(/\/+$/, '')}/v1/responses`;
  const cookie = cookieHeader(cookies);
  const res = await postUpstream(http, url, {
    json: body,
    headers: cookie ? { cookie } : {},
    signal,
  });
  let parsed: unknown;
  try {
    parsed = JSON.parse(res.body);
  } catch {
    parsed = undefined;
  }
  if (res.statusCode < 200 || res.statusCode >= 300) throw errorFromBody(res.statusCode, parsed);
  if (
    !isObject(parsed) ||
    !Array.isArray(parsed.output) ||
    !parsed.output.every((i) => isObject(i) && typeof i.type === 'string')
  ) {
    throw new UpstreamError(
      `the model server's reply is not a Responses API response: ${res.body.slice(0, 200)}`,
    );
  }
  return { body: parsed as JsonObject, setCookie: res.headers['set-cookie'] };
}

/** Runs one function call; its output is the raw reply text, whatever the status. */
async function callTool(
  http: Got,
  tools: ToolTarget | null,
  call: JsonObject,
  st: LoopState,
  signal: AbortSignal,
): Promise<string> {
  let args: unknown;
  try {
    args = JSON.parse(typeof call.arguments === 'string' ? call.arguments : '');
  } catch (err) {
    return JSON.stringify({ error: `Invalid tool call arguments: ${(err as Error).message}` });
  }
  if (!tools) {
    // The seed granted no tools to run the model's call with: the client's mistake, not ours.
    throw new InvalidRequestError(
      `the model called ${JSON.stringify(call.name)}, but this agent session has no tool access to run it with`,
    );
  }
  if ('mcp' in tools) return tools.mcp.call(String(call.name), args, signal);
  const cookie = cookieHeader(st.resources_server_cookies);
  const res = await postUpstream(http, `${tools.baseUrl}/${String(call.name)}`, {
    json: args,
    headers: { ...tools.headers, ...(cookie ? { cookie } : {}) },
    signal,
  });
  st.resources_server_cookies = mergeSetCookies(
    st.resources_server_cookies,
    res.headers['set-cookie'],
  );
  return res.body;
}

// --- the agent ------------------------------------------------------------------------------

/** What an export was built from (observations grow in place, so their length counts too). */
interface ExportedFrom {
  readonly request: unknown;
  readonly resourcesCookies: unknown;
  readonly observations: unknown;
  readonly observationCount: number;
  readonly activations: number;
  readonly completedActivation: number;
  readonly completedReply: unknown;
}

/** Each entry's last export with what it was built from. */
const lastExports = new WeakMap<
  AgentSessionEntry<SimpleSessionState>,
  { value: JsonObject; from: ExportedFrom }
>();

function exportedFrom(entry: AgentSessionEntry<SimpleSessionState>): ExportedFrom {
  return {
    request: entry.request,
    resourcesCookies: entry.state.resourcesCookies,
    observations: entry.state.observations,
    observationCount: entry.state.observations.length,
    activations: entry.activations,
    completedActivation: entry.completedActivation,
    completedReply: entry.completedReply,
  };
}

/** Compared part by part, building nothing: a commit asks this of every held session. */
function unchangedSince(from: ExportedFrom, entry: AgentSessionEntry<SimpleSessionState>): boolean {
  return (
    from.request === entry.request &&
    from.resourcesCookies === entry.state.resourcesCookies &&
    from.observations === entry.state.observations &&
    from.observationCount === entry.state.observations.length &&
    from.activations === entry.activations &&
    from.completedActivation === entry.completedActivation &&
    from.completedReply === entry.completedReply
  );
}

/**
 * What a session's export holds: the same object while nothing in it changed, so the agent
 * participant reuses the JSON it encoded ahead of a commit.
 */
export function exportSession(entry: AgentSessionEntry<SimpleSessionState>): JsonObject {
  const last = lastExports.get(entry);
  if (last && unchangedSince(last.from, entry)) return last.value;
  const from = exportedFrom(entry);
  // The seed request and a kept reply never change: each is encoded once, at its first export.
  const value: JsonObject = {
    request: encodeOnce(entry.request) as unknown as JsonObject,
    resources_cookies: entry.state.resourcesCookies,
    observations: entry.state.observations,
    activations: entry.activations,
    completed_activation: entry.completedActivation,
    completed_reply: encodeOnce(entry.completedReply) as unknown as JsonValue,
  };
  lastExports.set(entry, { value, from });
  return value;
}

const TRANSPORT_NAMES: Record<ToolTransport, string> = { direct_http: 'direct HTTP', mcp: 'MCP' };

/**
 * The seed's one grant of the agent's tool transport (or none). The other transport's grants go
 * unused, so a required one is refused, as is anything else Simple Agent cannot serve.
 */
export function seedToolAccess(
  request: AgentSeedRequest,
  transport: ToolTransport,
): DirectHttpToolAccess | McpToolAccess | null {
  if (request.sandbox_access !== null) {
    throw new InvalidRequestError('Simple Agent does not support sandbox_access');
  }
  const other: ToolTransport = transport === 'mcp' ? 'direct_http' : 'mcp';
  if (request.tool_accesses.some((a) => a.kind === other && a.required === true)) {
    throw new InvalidRequestError(
      `Simple Agent does not support a required ${TRANSPORT_NAMES[other]} tool access` +
        (transport === 'mcp' ? ' when its tool_transport is mcp' : ''),
    );
  }
  const chosen = request.tool_accesses.filter((a) => a.kind === transport);
  if (chosen.length > 1) {
    throw new InvalidRequestError(
      `Simple Agent supports at most one ${TRANSPORT_NAMES[transport]} tool access`,
    );
  }
  if (!chosen[0]) return null;
  return transport === 'mcp' ? parseMcpGrant(chosen[0]) : parseDirectHttpGrant(chosen[0]);
}

function seedState(request: AgentSeedRequest, transport: ToolTransport): SimpleSessionState {
  const access = seedToolAccess(request, transport);
  return {
    toolAccess: access,
    resourcesCookies: access?.kind === 'direct_http' ? { ...access.cookies } : null,
    observations: [],
  };
}

/**
 * A restored session. Its fingerprint is encoded only if a seed retry asks (most restored sessions
 * are never compared), and a class keeps the getter off each instance.
 */
class RestoredEntry implements AgentSessionEntry<SimpleSessionState> {
  closing = false;
  #fingerprint: string | undefined;

  constructor(
    readonly id: string,
    readonly request: AgentSeedRequest,
    public episode: EpisodeId,
    public activations: number,
    public completedActivation: number,
    public completedReply: StoredReply | null,
    public state: SimpleSessionState,
  ) {}

  get fingerprint(): string {
    return (this.#fingerprint ??= seedFingerprint(this.request));
  }
}

function restoreEntry(
  r: RestoredAgentSession,
  transport: ToolTransport,
): AgentSessionEntry<SimpleSessionState> {
  const s = r.session as Record<string, JsonValue>;
  if (!isObject(s.request))
    throw new CheckpointError(`restored session ${r.sessionKey} has no seed request`);
  const request = { ...(s.request as unknown as AgentSeedRequest), episode_id: r.episode };
  const state: SimpleSessionState = {
    toolAccess: seedToolAccess(request, transport),
    resourcesCookies: (s.resources_cookies ?? null) as Record<string, string> | null,
    // Only ever appended to: its items are encoded once, at the first export that writes them.
    observations: appendOnly((s.observations ?? []) as JsonObject[]),
  };
  return new RestoredEntry(
    r.sessionKey,
    request,
    r.episode,
    Number(s.activations ?? 0),
    Number(s.completed_activation ?? 0),
    (s.completed_reply ?? null) as StoredReply | null,
    state,
  );
}

export class SimpleAgent implements Agent<SimpleSessionState> {
  readonly checkpointSessionsSupported = true;
  readonly hooks: AgentSessionHooks;
  readonly config: SimpleAgentConfig;
  private readonly sessions: AgentSessionTable<SimpleSessionState>;

  constructor(private readonly context: AgentContext<SimpleSessionState>) {
    this.config = simpleAgentConfig(context.config);
    this.sessions = context.sessions;
    const sessions = this.sessions;
    this.hooks = {
      exportAgentSessions: async (keys) => {
        const out = new Map<string, JsonValue>();
        for (const key of keys) {
          const entry = sessions.get(key);
          if (entry) out.set(key, exportSession(entry));
        }
        return out;
      },
      // Each session's state is decoded when the session is first used.
      restoreAgentSessions: async (restored) => {
        for (const r of restored) {
          sessions.setRestored(r.sessionKey, () => restoreEntry(r, this.config.toolTransport));
        }
      },
      // A session with a close receipt was closed; otherwise it is freed here.
      retireAgentSession: async (key) => {
        if (!sessions.hasReceipt(key)) sessions.delete(key);
      },
    };
  }

  async seedSession(request: AgentSeedRequest): Promise<SimpleSessionState> {
    return seedState(request, this.config.toolTransport);
  }

  /** A direct HTTP target for the invocation (a call without a session uses `resources_server`). */
  private directTools(inv: Invocation<SimpleSessionState>): ToolTarget | null {
    const access = inv.session?.state.toolAccess ?? null;
    if (access?.kind === 'direct_http') {
      const baseUrl = toolBaseUrl(access.base_url, inv.episode);
      return { baseUrl, headers: access.headers };
    }
    if (inv.session !== null || !this.config.resourcesServerUrl) return null;
    const baseUrl = toolBaseUrl(this.config.resourcesServerUrl, inv.episode);
    return { baseUrl, headers: {} };
  }

  async respond(inv: Invocation<SimpleSessionState>): Promise<AgentReply> {
    const access = inv.session?.state.toolAccess;
    if (access?.kind !== 'mcp') return this.runLoop(inv, this.directTools(inv), inv.body);
    // One MCP connection per activation: its tools join the request's, its calls run the loop's.
    await using mcp = await McpTools.connect(access, inv.handle.signal);
    // Awaited here: the connection closes when the loop is done, not when its promise is made.
    return await this.runLoop(inv, { mcp }, withMcpTools(inv.body, mcp.tools));
  }

  private async runLoop(
    inv: Invocation<SimpleSessionState>,
    tools: ToolTarget | null,
    body: JsonObject,
  ): Promise<AgentReply> {
    const session = inv.session;
    const result = await runTurnLoop({
      http: this.context.clients.data,
      config: this.config,
      body,
      episode: inv.episode,
      handle: inv.handle,
      invocationId: inv.invocationId,
      tools,
      jar: session ? session.state.resourcesCookies : { ...inv.cookies },
      modelCookies: {},
    });
    const response = inv.keepTrajectory
      ? { ...result.response, _ng_trajectory: result.trajectory }
      : result.response;
    if (session) {
      session.state.resourcesCookies = result.state.resources_server_cookies;
      // Encoded once, now: each checkpoint after writes these bytes.
      appendEncoded(session.state.observations, result.trajectory);
      return { response, cookies: result.state.model_server_cookies };
    }
    return {
      response,
      cookies: {
        ...result.state.model_server_cookies,
        ...(result.state.resources_server_cookies ?? {}),
      },
    };
  }

  async legacyRun(request: LegacyRunRequest): Promise<JsonObject> {
    const resources = this.config.resourcesServerUrl;
    if (resources === null) {
      throw new InvalidRequestError(
        'this Simple Agent has no resources_server to run /run against',
      );
    }
    return legacyRun({
      ...request,
      http: this.context.clients.data,
      settings: {
        resourcesServerUrl: resources,
        skipVerification: this.config.skipVerification,
        skipVerificationReward: this.config.skipVerificationReward,
      },
      logger: this.context.logger,
    });
  }

  async closeSession(entry: AgentSessionEntry<SimpleSessionState>): Promise<AgentCloseResult> {
    return {
      agent_observations: { invocations: entry.state.observations },
      resources_cookies: entry.state.resourcesCookies,
    };
  }
}

export function simpleAgent(context: AgentContext<SimpleSessionState>): SimpleAgent {
  return new SimpleAgent(context);
}
