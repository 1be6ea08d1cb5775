/**
 * The agent session contract, `POST /v1/agent_sessions` and `/v1/agent_sessions/close`: the seed an
 * environment server sends, the activation index header of `/v1/responses`, the close, and the
 * receipt the agent answers it with. The environment server builds these values; the agent server
 * reads the requests with the parsers here.
 */
import { ActivationOutOfOrderError } from '../errors.js';
import { AGENT_ACTIVATION_HEADER } from '../headers.js';
import type { EpisodeId } from '../identity.js';
import type { JsonObject, JsonValue } from '../json.js';
import {
  closedObject,
  compileWire,
  EPISODE_ID_SCHEMA,
  type EpisodeIdJson,
  episodeFromJson,
  refuse,
  SESSION_ID_SCHEMA,
} from './validate.js';

/** A tool grant: its `kind` says how the agent reaches the tools (`direct_http`, `mcp`, …). */
export type ToolAccess = JsonObject & { kind: string; name: string };

/** The grant of tools the agent calls over plain HTTP, under the episode's rollout prefix. */
export type DirectHttpGrant = {
  kind: 'direct_http';
  name: string;
  required: boolean;
  base_url: string;
  cookies: Record<string, string>;
  headers?: Record<string, string>;
};

/** The grant of tools the agent calls over MCP (streamable HTTP). */
export type McpGrant = {
  kind: 'mcp';
  name: string;
  required: boolean;
  connection: { transport: 'streamable_http'; url: string; headers: JsonObject };
};

/** A direct HTTP grant as an agent reads it: its defaults filled in. */
export interface DirectHttpToolAccess {
  kind: 'direct_http';
  name: string;
  required: boolean;
  base_url: string;
  cookies: Record<string, string>;
  headers: Record<string, string>;
}

/** An MCP grant as an agent reads it: the headers it sends with every MCP request checked. */
export interface McpToolAccess {
  kind: 'mcp';
  name: string;
  required: boolean;
  url: string;
  headers: Record<string, string>;
}

/** `POST /v1/agent_sessions`. */
export interface AgentSeedRequest {
  agent_session_id: string;
  episode_id: EpisodeId;
  /** The task's id, opaque to the agent. */
  task_id: JsonValue;
  /** Names unique. */
  tool_accesses: ToolAccess[];
  sandbox_access: JsonObject | null;
}

/** The seed's reply body (the session cookie comes with it). */
export interface AgentSeedReply {
  agent_session_id: string;
}

/** `POST /v1/agent_sessions/close`; `episode_id`, when given, must be the seeding attempt. */
export interface AgentCloseRequest {
  agent_session_id: string;
  episode_id?: EpisodeId;
}

/** The close's reply, kept for retries of the same close. */
export interface CloseReceipt {
  agent_session_id: string;
  agent_observations: JsonValue;
  /** The resources session's cookies as the agent's tool calls left them; null if none. */
  resources_cookies: Record<string, string> | null;
}

const SEED_SCHEMA = closedObject(
  {
    agent_session_id: SESSION_ID_SCHEMA,
    episode_id: EPISODE_ID_SCHEMA,
    task_id: {},
    // null reads as no grants, as an absent field does.
    tool_accesses: {
      type: ['array', 'null'],
      reason: 'must be a list of objects',
      items: {
        type: 'object',
        reason: 'needs string kind and name',
        required: ['kind', 'name'],
        properties: {
          kind: { type: 'string', reason: 'needs string kind and name' },
          name: { type: 'string', reason: 'needs string kind and name' },
        },
      },
    },
    sandbox_access: { type: ['object', 'null'], reason: 'must be an object or null' },
  },
  ['agent_session_id', 'episode_id'],
);

const CLOSE_SCHEMA = {
  type: 'object',
  reason: 'must be a JSON object',
  required: ['agent_session_id'],
  properties: { agent_session_id: SESSION_ID_SCHEMA, episode_id: EPISODE_ID_SCHEMA },
} as const;

type SeedJson = Omit<
  AgentSeedRequest,
  'episode_id' | 'task_id' | 'tool_accesses' | 'sandbox_access'
> & {
  episode_id: EpisodeIdJson;
  task_id?: JsonValue;
  tool_accesses?: ToolAccess[] | null;
  sandbox_access?: JsonObject | null;
};

/** An HTTP token: what a header or cookie name may be. */
const TOKEN = "^[!#$%&'*+.^_`|~0-9A-Za-z-]+$";
/** What node lets into a header value; a cookie value may not hold `;` besides. */
const HEADER_VALUE = '^[\\t\\x20-\\x7e\\x80-\\xff]*$';
const COOKIE_VALUE = '^[\\t\\x20-\\x3a\\x3c-\\x7e\\x80-\\xff]*$';
const SENDABLE = 'must map HTTP token names to strings valid in a header';

/** `name: value` strings that can be sent as such (else the tool call would fail on its way). */
function sendable(valuePattern: string) {
  return {
    type: 'object',
    reason: SENDABLE,
    propertyNames: { pattern: TOKEN, reason: SENDABLE },
    additionalProperties: { type: 'string', pattern: valuePattern, reason: SENDABLE },
  } as const;
}

const DIRECT_HTTP_SCHEMA = {
  type: 'object',
  required: ['base_url'],
  properties: {
    base_url: { type: 'string', format: 'http-url', reason: 'must be an http(s) URL' },
    cookies: sendable(COOKIE_VALUE),
    headers: sendable(HEADER_VALUE),
  },
} as const;

const MCP_SCHEMA = {
  type: 'object',
  required: ['connection'],
  properties: {
    connection: {
      type: 'object',
      reason: 'must be {"transport": "streamable_http", "url": …, "headers": …}',
      required: ['transport', 'url'],
      properties: {
        transport: {
          type: 'string',
          enum: ['streamable_http'],
          reason: 'only the streamable_http transport is supported',
        },
        url: { type: 'string', format: 'http-url', reason: 'must be an http(s) URL' },
        headers: sendable(HEADER_VALUE),
      },
    },
  },
} as const;

const checkSeed = compileWire<SeedJson>(SEED_SCHEMA);
const checkClose = compileWire<{ agent_session_id: string; episode_id?: EpisodeIdJson }>(
  CLOSE_SCHEMA,
);

/** Reads a seed body (extra fields refused, tool access names unique); 422 `invalid_request`. */
export function parseAgentSeedRequest(body: unknown): AgentSeedRequest {
  const seed = checkSeed(body);
  const accesses = seed.tool_accesses ?? [];
  const names = new Set<string>();
  for (const [i, access] of accesses.entries()) {
    if (names.has(access.name)) refuse(`tool_accesses[${i}]`, `name ${access.name} is not unique`);
    names.add(access.name);
  }
  // Built in one key order: the seed's canonical text tells an identical retry from a conflict.
  return {
    agent_session_id: seed.agent_session_id,
    episode_id: episodeFromJson(seed.episode_id),
    task_id: seed.task_id ?? null,
    tool_accesses: accesses,
    sandbox_access: seed.sandbox_access ?? null,
  };
}

const checkDirectHttp = compileWire<{
  base_url: string;
  required?: unknown;
  cookies?: Record<string, string>;
  headers?: Record<string, string>;
}>(DIRECT_HTTP_SCHEMA);

/**
 * Reads a direct HTTP grant of a seed; anything malformed is 422 `invalid_request`, also cookies
 * and headers that could not be sent as such (the tool call would fail on its way, a 502 of ours).
 */
export function parseDirectHttpGrant(access: ToolAccess): DirectHttpToolAccess {
  const grant = checkDirectHttp(access, `tool access ${JSON.stringify(String(access.name))}`);
  return {
    kind: 'direct_http',
    name: String(access.name),
    required: grant.required === true,
    base_url: grant.base_url,
    cookies: grant.cookies ?? {},
    headers: grant.headers ?? {},
  };
}

const checkMcp = compileWire<{
  required?: unknown;
  connection: { url: string; headers?: Record<string, string> };
}>(MCP_SCHEMA);

/**
 * Reads an MCP grant of a seed; anything malformed is 422 `invalid_request`, also headers that
 * could not be sent as such (every MCP request would fail on its way).
 */
export function parseMcpGrant(access: ToolAccess): McpToolAccess {
  const grant = checkMcp(access, `tool access ${JSON.stringify(String(access.name))}`);
  return {
    kind: 'mcp',
    name: String(access.name),
    required: grant.required === true,
    url: grant.connection.url,
    headers: grant.connection.headers ?? {},
  };
}

/** Reads a close body (other fields are ignored); 422 `invalid_request`. */
export function parseAgentCloseRequest(body: unknown): AgentCloseRequest {
  const close = checkClose(body);
  return close.episode_id === undefined
    ? { agent_session_id: close.agent_session_id }
    : { agent_session_id: close.agent_session_id, episode_id: episodeFromJson(close.episode_id) };
}

/** The `x-ng-agent-activation` header of activation `index` (1-based). */
export function activationHeader(index: number): Record<string, string> {
  return { [AGENT_ACTIVATION_HEADER]: String(index) };
}

/** Reads the activation header; anything but a positive integer is `activation_out_of_order`. */
export function parseActivationHeader(value: string | undefined): number | null {
  if (value === undefined) return null;
  if (!/^[1-9][0-9]*$/.test(value.trim()) || !Number.isSafeInteger(Number(value.trim()))) {
    throw new ActivationOutOfOrderError(
      `${AGENT_ACTIVATION_HEADER} must be a positive integer, got '${value}'`,
    );
  }
  return Number(value.trim());
}
