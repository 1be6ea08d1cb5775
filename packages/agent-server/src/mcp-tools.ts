/**
 * Simple Agent's tools over MCP: one client connection (the official SDK's `Client` over Streamable
 * HTTP) per activation, to the URL and with the headers (the session token) of the seed's MCP
 * grant. The listed tools become the model's function tools; each function call is one MCP
 * `tools/call`. A refusal of the server (an HTTP error status, e.g. 409 `stale_attempt` for a
 * fenced token) fails the activation with the server's typed error; a tool's own error is its
 * output, as a direct HTTP tool's error reply is.
 */
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import {
  StreamableHTTPClientTransport,
  StreamableHTTPError,
} from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { McpError } from '@modelcontextprotocol/sdk/types.js';

import {
  CkptGymError,
  errorFromBody,
  type JsonObject,
  type McpToolAccess,
  UpstreamError,
} from '@ckpt-gym/core/protocol';
import { requestIdHeaders } from '@ckpt-gym/core/client';

/** How the agent names itself to MCP servers (the package's version). */
const CLIENT_INFO = { name: 'ckpt-gym-simple-agent', version: '0.1.0' };

/**
 * The text the model sees for a tool's result: its text content, else its structured content as
 * JSON (an error result reads the same: the model is told what went wrong, as over direct HTTP).
 */
export function toolOutputText(result: Readonly<Record<string, unknown>>): string {
  const texts = Array.isArray(result.content)
    ? result.content.flatMap((c: { type?: unknown; text?: unknown }) =>
        c.type === 'text' && typeof c.text === 'string' ? [c.text] : [],
      )
    : [];
  if (texts.length > 0) return texts.join('\n');
  return JSON.stringify(result.structuredContent ?? null);
}

/** A listed MCP tool as a Responses API function tool. */
export function functionTool(tool: {
  name: string;
  description?: string;
  inputSchema: object;
}): JsonObject {
  return {
    type: 'function',
    name: tool.name,
    ...(tool.description === undefined ? {} : { description: tool.description }),
    parameters: tool.inputSchema as JsonObject,
  };
}

/**
 * The request's tools with the MCP server's added; a function tool the request already names
 * keeps the request's definition.
 */
export function withMcpTools(body: JsonObject, listed: JsonObject[]): JsonObject {
  const own = Array.isArray(body.tools) ? (body.tools as JsonObject[]) : [];
  const named = new Set(own.map((t) => t.name));
  return { ...body, tools: [...own, ...listed.filter((t) => !named.has(t.name))] };
}

const POST_REFUSED = /^Streamable HTTP error: Error POSTing to endpoint: /;

/**
 * The typed error for a failed MCP exchange: the server's own error body when it refused the
 * request with an HTTP status (its code kept, e.g. `stale_attempt`), else `upstream_error`.
 */
export function mcpFailure(err: unknown, url: string): CkptGymError {
  if (err instanceof CkptGymError) return err;
  if (err instanceof StreamableHTTPError && err.code !== undefined && err.code >= 400) {
    const text = err.message.replace(POST_REFUSED, '');
    let body: unknown;
    try {
      body = JSON.parse(text);
    } catch {
      body = text;
    }
    return errorFromBody(err.code, body);
  }
  const detail = err instanceof Error ? err.message : String(err);
  return new UpstreamError(`MCP tools at ${url}: ${detail}`, { cause: err });
}

/** One activation's connection to its grant's tools. */
export class McpTools implements AsyncDisposable {
  private constructor(
    private readonly client: Client,
    private readonly url: string,
    /** The server's tools as function tools. */
    readonly tools: JsonObject[],
  ) {}

  /** Connects and lists the tools; a failure is typed (see `mcpFailure`). */
  static async connect(access: McpToolAccess, signal: AbortSignal): Promise<McpTools> {
    const client = new Client(CLIENT_INFO);
    // The activation's request id travels on every MCP request of this connection.
    const transport = new StreamableHTTPClientTransport(new URL(access.url), {
      requestInit: { headers: { ...requestIdHeaders(), ...access.headers } },
    });
    try {
      await client.connect(transport, { signal });
      const listed = await client.listTools(undefined, { signal });
      return new McpTools(client, access.url, listed.tools.map(functionTool));
    } catch (err) {
      await client.close().catch(() => undefined);
      throw signal.aborted ? err : mcpFailure(err, access.url);
    }
  }

  /** Runs one function call; a tool's JSON-RPC error is its output, a refused request throws. */
  async call(name: string, args: unknown, signal: AbortSignal): Promise<string> {
    try {
      const result = await this.client.callTool(
        { name, arguments: (args ?? {}) as Record<string, unknown> },
        undefined,
        { signal },
      );
      return toolOutputText(result);
    } catch (err) {
      if (signal.aborted) throw err;
      if (err instanceof McpError) {
        return JSON.stringify({ error: { code: err.code, message: err.message } });
      }
      throw mcpFailure(err, this.url);
    }
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.client.close().catch(() => undefined);
  }
}
