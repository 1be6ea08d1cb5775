/**
 * Simple Agent with `tool_transport: mcp` against a small real MCP server (the SDK's `McpServer`
 * over Streamable HTTP): the seed's MCP grant, the listed tools in the model's request, each
 * function call an MCP `tools/call`, and the server's refusals typed.
 */
import express from 'express';
import { z } from 'zod';

import { McpServer } from '@modelcontextprotocol/sdk/server/mcp.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';

import { listen, type ListeningServer } from '@ckpt-gym/core/server';

import { activate, errorCode, type Harness, seed, startStack } from './support/harness.js';

const TOKEN = 'Bearer good';

interface ToolServer extends AsyncDisposable {
  url: string;
  /** The cities `get_weather` ran for. */
  ran: string[];
  /** The authorization header of every MCP request. */
  auth: (string | undefined)[];
  /** The x-request-id header of every MCP request. */
  requestIds: (string | string[] | undefined)[];
  /** Refuse requests of this JSON-RPC method with 409 `stale_attempt`, before any tool runs. */
  fence: string | null;
}

/** A stateless MCP server with `get_weather` and `get_forecast`; a wrong token is `stale_attempt`. */
async function startToolServer(options: { weather?: boolean } = {}): Promise<ToolServer> {
  const ran: string[] = [];
  const auth: (string | undefined)[] = [];
  const app = express();
  app.use(express.json());
  const tools: ToolServer = {
    url: '',
    ran,
    auth,
    requestIds: [],
    fence: null,
    [Symbol.asyncDispose]: async () => undefined,
  };
  app.post('/mcp', async (req, res) => {
    auth.push(req.headers.authorization);
    tools.requestIds.push(req.headers['x-request-id']);
    const method = (req.body as { method?: string }).method;
    if (req.headers.authorization !== TOKEN || method === tools.fence) {
      res.status(409).json({ error: { code: 'stale_attempt', detail: 'token fenced' } });
      return;
    }
    const server = new McpServer({ name: 'weather', version: '1.0.0' });
    if (options.weather !== false) {
      server.registerTool(
        'get_weather',
        { description: 'The weather in a city', inputSchema: { city: z.string() } },
        async ({ city }) => {
          ran.push(city);
          return { content: [{ type: 'text', text: JSON.stringify({ city, weather: 'sunny' }) }] };
        },
      );
    }
    server.registerTool(
      'get_forecast',
      { description: 'The forecast', inputSchema: { days: z.number() } },
      async () => ({ content: [{ type: 'text', text: '[]' }] }),
    );
    const transport = new StreamableHTTPServerTransport({ sessionIdGenerator: undefined });
    res.on('close', () => void transport.close().then(() => server.close()));
    await server.connect(transport);
    await transport.handleRequest(req, res, req.body);
  });
  app.all('/mcp', (_req, res) => void res.status(405).end());
  const listening: ListeningServer = await listen(app, 0);
  tools.url = `${listening.url}/mcp`;
  tools[Symbol.asyncDispose] = () => listening.close();
  return tools;
}

function mcpGrant(url: string, token = TOKEN, name = 'weather') {
  return {
    kind: 'mcp',
    name,
    required: true,
    connection: { transport: 'streamable_http', url, headers: { authorization: token } },
  };
}

const onMcp = { config: { tool_transport: 'mcp' } };

function toolOutputs(body: Record<string, unknown>): unknown[] {
  return (body.output as { type: string; output?: unknown }[])
    .filter((o) => o.type === 'function_call_output')
    .map((o) => o.output);
}

async function seeded(h: Harness, tools: unknown[]) {
  const s = await seed(h, 'sess-1', 'r1', { tools });
  expect(s.reply.status).toBe(200);
  return s;
}

describe('Simple Agent over MCP', () => {
  test('a whole activation runs its function calls as MCP tool calls with the grant’s token', async () => {
    await using tools = await startToolServer();
    await using h = await startStack(onMcp);
    const s = await seeded(h, [mcpGrant(tools.url)]);
    const reply = await activate(h, s, 'r1', 1);
    expect(reply.status).toBe(200);
    expect(tools.ran).toEqual(['SF']);
    expect(toolOutputs(reply.body)).toEqual([JSON.stringify({ city: 'SF', weather: 'sunny' })]);
    expect((reply.body.output as { type: string }[]).at(-1)?.type).toBe('message');
    expect(new Set(tools.auth)).toEqual(new Set([TOKEN]));
    // No direct HTTP tool call was made.
    expect(h.resources.calls).toHaveLength(0);
  });

  test('every MCP request of an activation carries the activation’s request id', async () => {
    await using tools = await startToolServer();
    await using h = await startStack(onMcp);
    const s = await seeded(h, [mcpGrant(tools.url)]);
    const reply = await activate(h, s, 'r1', 1);
    const id = reply.headers.get('x-request-id');
    expect(id).toMatch(/^[0-9a-f-]{36}$/);
    expect(tools.requestIds.length).toBeGreaterThanOrEqual(3); // initialize, tools/list, tools/call
    expect(new Set(tools.requestIds)).toEqual(new Set([id]));
  });

  test('the listed tools join the request’s in the model’s request; the request’s own keep theirs', async () => {
    await using tools = await startToolServer();
    await using h = await startStack(onMcp);
    const s = await seeded(h, [mcpGrant(tools.url)]);
    await activate(h, s, 'r1', 1);
    const sent = h.model.calls[0]!.body.tools as { name: string; parameters: unknown }[];
    expect(sent.map((t) => t.name)).toEqual(['get_weather', 'get_forecast']);
    // get_weather is the request's (empty parameters); get_forecast is the MCP server's schema.
    expect(sent[0]!.parameters).toEqual({});
    expect(sent[1]!.parameters).toMatchObject({
      type: 'object',
      properties: { days: { type: 'number' } },
    });
  });

  test('a refused MCP request fails the activation with the server’s typed error, no tool run', async () => {
    await using tools = await startToolServer();
    await using h = await startStack(onMcp);
    const stale = await seeded(h, [mcpGrant(tools.url, 'Bearer old')]);
    const refused = await activate(h, stale, 'r1', 1);
    expect(refused.status).toBe(409);
    expect(errorCode(refused)).toBe('stale_attempt');
    expect(tools.ran).toEqual([]);
    expect(h.model.calls).toHaveLength(0);
  });

  test('a tools/call the server refuses fails the activation with its code', async () => {
    await using tools = await startToolServer();
    tools.fence = 'tools/call';
    await using h = await startStack(onMcp);
    const s = await seeded(h, [mcpGrant(tools.url)]);
    const refused = await activate(h, s, 'r1', 1);
    expect(refused.status).toBe(409);
    expect(errorCode(refused)).toBe('stale_attempt');
    expect(tools.ran).toEqual([]);
  });

  test('an unreachable MCP server is upstream_error', async () => {
    const tools = await startToolServer();
    const url = tools.url;
    await tools[Symbol.asyncDispose]();
    await using h = await startStack(onMcp);
    const s = await seeded(h, [mcpGrant(url)]);
    const reply = await activate(h, s, 'r1', 1);
    expect(reply.status).toBe(502);
    expect(errorCode(reply)).toBe('upstream_error');
  });

  test('a call of a tool the server lacks is the tool’s error output, and the loop goes on', async () => {
    await using tools = await startToolServer({ weather: false });
    await using h = await startStack(onMcp);
    const s = await seeded(h, [mcpGrant(tools.url)]);
    const reply = await activate(h, s, 'r1', 1);
    expect(reply.status).toBe(200);
    const [output] = toolOutputs(reply.body) as string[];
    expect(output).toContain('get_weather');
    expect((reply.body.output as { type: string }[]).at(-1)?.type).toBe('message');
  });

  test('the seed must hold at most one MCP grant, and no required direct HTTP one', async () => {
    await using h = await startStack(onMcp);
    const url = 'http://127.0.0.1:1/mcp';
    const two = await seed(h, 'sess-2', 'r2', {
      tools: [mcpGrant(url, TOKEN, 'a'), mcpGrant(url, TOKEN, 'b')],
    });
    expect(two.reply.status).toBe(422);
    expect(two.reply.body.error).toMatchObject({ code: 'invalid_request' });
    const direct = await seed(h, 'sess-3', 'r3'); // the harness's required direct HTTP grant
    expect(direct.reply.status).toBe(422);
    expect(JSON.stringify(direct.reply.body)).toContain('required direct HTTP tool access');
  });

  test('a malformed MCP grant is refused at seed', async () => {
    await using h = await startStack(onMcp);
    const badUrl = await seed(h, 'sess-4', 'r4', { tools: [mcpGrant('not a url')] });
    expect(badUrl.reply.status).toBe(422);
    const grant = mcpGrant('http://127.0.0.1:1/mcp');
    const badTransport = await seed(h, 'sess-5', 'r5', {
      tools: [{ ...grant, connection: { ...grant.connection, transport: 'sse' } }],
    });
    expect(badTransport.reply.status).toBe(422);
    const badHeader = await seed(h, 'sess-6', 'r6', {
      tools: [{ ...grant, connection: { ...grant.connection, headers: { authorization: 1 } } }],
    });
    expect(badHeader.reply.status).toBe(422);
  });

  test('with the default transport the MCP grant goes unused and tools stay direct HTTP', async () => {
    await using tools = await startToolServer();
    await using h = await startStack();
    const s = await seeded(h, [
      { ...mcpGrant(tools.url), required: false },
      {
        kind: 'direct_http',
        name: 'weather.direct',
        required: true,
        base_url: `${h.resources.url}/ng-rollout/r1`,
        cookies: {},
      },
    ]);
    const reply = await activate(h, s, 'r1', 1);
    expect(reply.status).toBe(200);
    expect(h.resources.calls).toHaveLength(1);
    expect(tools.auth).toEqual([]);
  });
});
