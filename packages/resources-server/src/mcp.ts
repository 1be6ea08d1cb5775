/**
 * MCP exposure (`expose_tools_over_mcp`): the server's tools over MCP's Streamable HTTP transport
 * at `POST /mcp`, with the official SDK in stateless mode (a fresh SDK server per POST, JSON
 * replies). The tools are the definition's tools only (never the seed, close, verify or metrics
 * routes, nor the checkpoint control routes), each called under the session and attempt of the
 * request's MCP token (mcp-token.ts).
 *
 * The endpoint is a route on core's lifecycle like every session route: the POST that carries a
 * `tools/call` is admitted by the resources participant as a tool call on the token's session,
 * before the SDK reads it, and released after its reply is written — so it waits out an open
 * checkpoint, holds up prepare while in flight, is drained and refused by a retire, and a stale
 * attempt is refused 409 `stale_attempt` before its tool runs. Other MCP messages (initialize,
 * tools/list, notifications) touch no session state and are not admitted.
 */
import { finished } from 'node:stream/promises';

import {
  type EpisodeId,
  type JsonObject,
  type JsonValue,
  type ResourcesTools,
  toClientError,
} from '@ckpt-gym/core/protocol';
import { gymRoute, type GymRoute, type Logger } from '@ckpt-gym/core/server';
import { Server } from '@modelcontextprotocol/sdk/server/index.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import {
  CallToolRequestSchema,
  type CallToolResult,
  ErrorCode,
  ListToolsRequestSchema,
  McpError,
} from '@modelcontextprotocol/sdk/types.js';
import type { Request, Response } from 'express';

import type { Declarations, ResourcesServerDefinition } from './definition.js';
import { type McpTokenClaims, McpTokens, tokenAttempt } from './mcp-token.js';
import type { Admission, ResourcesParticipant } from './participant.js';

export const MCP_ROUTE = '/mcp';
const CALL_TOOL = 'tools/call';

/** A server's MCP exposure: its tools and the tokens that reach them. */
export interface McpExposure {
  readonly serverName: string;
  readonly definition: ResourcesServerDefinition;
  /** The tools exposed: every tool except declared session starts (a session starts at a seed). */
  readonly tools: readonly string[];
  readonly tokens: McpTokens;
  readonly participant: ResourcesParticipant | undefined;
  readonly logger: Logger;
  readonly bodyLimit: string;
}

export function mcpToolNames(
  definition: ResourcesServerDefinition,
  declarations: Declarations,
): string[] {
  return Object.keys(definition.tools).filter(
    (name) => !declarations.sessionStarts.includes(`/${name}`),
  );
}

/**
 * The seed reply's `resources_tools`: where the session's tools are and the token that reaches
 * them. The token names the seeding attempt exactly when checkpointing is on.
 */
export function resourcesTools(
  mcp: McpExposure,
  sessionId: string,
  episode: EpisodeId | undefined,
): ResourcesTools & JsonObject {
  const attempt = mcp.participant ? episode : undefined;
  const token = mcp.tokens.mint(sessionId, mcp.tools, attempt);
  return {
    transport: 'http',
    server_name: mcp.serverName,
    url_path: MCP_ROUTE,
    headers: { Authorization: `Bearer ${token}` },
  };
}

/** What admission leaves an MCP POST: the token's claims, and a tool call's attempt and pass. */
interface McpAdmitted {
  readonly claims: McpTokenClaims;
  readonly episode: EpisodeId | undefined;
  readonly admission: Admission | undefined;
}

/** `POST /mcp`, and `GET /mcp` answered 405: a stateless server opens no event stream. */
export function mcpRoutes(mcp: McpExposure): GymRoute[] {
  const post = gymRoute({
    method: 'post',
    path: MCP_ROUTE,
    // The token names the attempt; a rollout prefix adds nothing.
    episode: 'none',
    body: { limit: mcp.bodyLimit, parse: (body) => body },
    admit: async ({ req, body, signal }): Promise<McpAdmitted> => {
      const claims = mcp.tokens.read(req.get('authorization'));
      if (body.method !== CALL_TOOL) return { claims, episode: undefined, admission: undefined };
      const episode = tokenAttempt(claims, mcp.participant !== undefined);
      const admission = await mcp.participant?.admit({
        role: 'tool',
        path: `${MCP_ROUTE} ${toolNameOf(body)}`,
        sessionId: claims.session_id,
        episode,
        closeFollows: false,
        signal,
      });
      return { claims, episode, admission };
    },
    release: ({ admission }) => admission?.release(),
    run: ({ req, res, body, signal }, admitted) =>
      serveMcp(mcp, admitted, { req, res, body, signal }),
    reply: 'streamed',
  });
  const get = gymRoute({
    method: 'get',
    path: MCP_ROUTE,
    episode: 'none',
    run: () => ({
      jsonrpc: '2.0',
      error: { code: -32000, message: 'Method not allowed: this MCP server is stateless' },
      id: null,
    }),
    reply: (res, result) => res.status(405).set('Allow', 'POST').json(result),
  });
  return [post, get];
}

function toolNameOf(body: JsonObject): string {
  const params = body.params;
  const name =
    typeof params === 'object' && params !== null && !Array.isArray(params)
      ? params.name
      : undefined;
  return typeof name === 'string' ? name : '(unnamed tool)';
}

interface McpRequest {
  readonly req: Request;
  readonly res: Response;
  readonly body: JsonObject;
  readonly signal: AbortSignal;
}

/** Hands one POST to a fresh SDK server; resolves once its reply is written (then it is released). */
async function serveMcp(mcp: McpExposure, admitted: McpAdmitted, request: McpRequest) {
  const server = sdkServer(mcp, admitted, request.signal);
  const transport = new StreamableHTTPServerTransport({
    sessionIdGenerator: undefined,
    enableJsonResponse: true,
  });
  await server.connect(transport);
  try {
    await transport.handleRequest(request.req, request.res, request.body);
    await finished(request.res).catch(() => undefined);
  } finally {
    await server.close();
  }
}

/** The SDK server of one POST: the token's tools, each run under the token's session. */
function sdkServer(mcp: McpExposure, admitted: McpAdmitted, signal: AbortSignal): Server {
  const { claims } = admitted;
  const allowed = mcp.tools.filter((name) => claims.tools.includes(name));
  const server = new Server(
    { name: mcp.serverName, version: '1.0.0' },
    { capabilities: { tools: {} } },
  );
  server.setRequestHandler(ListToolsRequestSchema, () => ({
    tools: allowed.map((name) => ({ name, inputSchema: { type: 'object' as const } })),
  }));
  server.setRequestHandler(CallToolRequestSchema, async (call, extra) => {
    const { name } = call.params;
    const handler = allowed.includes(name) ? mcp.definition.tools[name] : undefined;
    if (!handler) throw new McpError(ErrorCode.InvalidParams, `unknown tool '${name}'`);
    let endRequested = false;
    try {
      const reply = await handler({
        sessionId: claims.session_id,
        episode: admitted.episode,
        body: (call.params.arguments ?? {}) as JsonObject,
        signal: AbortSignal.any([signal, extra.signal]),
        endSession: () => {
          endRequested = true;
        },
      });
      admitted.admission?.succeeded(claims.session_id, endRequested);
      return toolResult(reply);
    } catch (err) {
      return toolError(mcp.logger, name, err);
    }
  });
  return server;
}

function toolResult(reply: JsonValue): CallToolResult {
  const structured =
    typeof reply === 'object' && reply !== null && !Array.isArray(reply)
      ? { structuredContent: reply }
      : {};
  return { content: [{ type: 'text', text: JSON.stringify(reply) }], ...structured };
}

/** A tool's failure as an MCP tool error carrying the catalogue's error body. */
function toolError(logger: Logger, tool: string, err: unknown): CallToolResult {
  const error = toClientError(err);
  if (error.code === 'internal_error') {
    logger.error('MCP tool call failed', { tool, error: (err as Error)?.stack ?? String(err) });
  }
  return { content: [{ type: 'text', text: JSON.stringify(error.toBody()) }], isError: true };
}
