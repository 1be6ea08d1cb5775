/**
 * MCP exposure with the official MCP client (`Client` over `StreamableHTTPClientTransport`)
 * against real servers on free ports: the tools and nothing else, the session token that names
 * its attempt, and the checkpoint semantics of the one POST that carries each tool call.
 */
import type { JsonObject } from '@ckpt-gym/core/protocol';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import type { CallToolResult } from '@modelcontextprotocol/sdk/types.js';

import { counterServer, weatherServer } from '../src/index.js';
import { cleanUp, startServer, type TestServer } from './support.js';

const clients = new Set<Client>();

afterEach(async () => {
  await Promise.all([...clients].map((c) => c.close()));
  clients.clear();
  await cleanUp();
});

interface Seeded {
  readonly cookie: string;
  /** The seed reply's `resources_tools`. */
  readonly tools: JsonObject;
}

/** Seeds a session (legacy body) under `key`, optionally with a cookie, and returns its MCP grant. */
async function seed(
  server: TestServer,
  key: string | undefined,
  body: JsonObject = {},
  cookie?: string,
): Promise<Seeded> {
  const reply = await server.post('/seed_session', body, {
    ...(key === undefined ? {} : { key }),
    ...(cookie ? { cookie } : {}),
  });
  if (reply.status !== 200) throw new Error(`seed failed: ${JSON.stringify(reply.body)}`);
  return {
    cookie: reply.setCookie ?? (cookie as string),
    tools: reply.body.resources_tools as JsonObject,
  };
}

/** The official MCP client, connected as a harness given `tools` would connect. */
async function connect(server: TestServer, tools: JsonObject): Promise<Client> {
  const url = new URL(`${server.url}${tools.url_path as string}`);
  const transport = new StreamableHTTPClientTransport(url, {
    requestInit: { headers: tools.headers as Record<string, string> },
  });
  const client = new Client({ name: 'test-harness', version: '1.0.0' });
  await client.connect(transport);
  clients.add(client);
  return client;
}

/** A tool result's JSON reply. */
function replyOf(result: unknown): JsonObject {
  const content = (result as CallToolResult).content[0];
  if (content?.type !== 'text') throw new Error(`no text content: ${JSON.stringify(result)}`);
  return JSON.parse(content.text) as JsonObject;
}

describe('tools over MCP', () => {
  test.each([true, false])(
    'the counter and weather tools are listed and called over MCP, and no framework or control route is a tool (checkpointing %s)',
    async (checkpoint) => {
      const counter = await startServer(counterServer(), {
        mcp: true,
        checkpoint,
        name: 'counter',
      });
      const weather = await startServer(weatherServer(), {
        mcp: true,
        checkpoint,
        name: 'weather',
      });
      const key = checkpoint ? 'r1' : undefined;

      const c = await seed(counter, key);
      expect(c.tools).toMatchObject({
        transport: 'http',
        server_name: 'counter',
        url_path: '/mcp',
      });
      const cc = await connect(counter, c.tools);
      const counterTools = (await cc.listTools()).tools.map((t) => t.name).sort();
      expect(counterTools).toEqual(['get_counter_value', 'increment_counter']);
      await cc.callTool({ name: 'increment_counter', arguments: { count: 2 } });
      await cc.callTool({ name: 'increment_counter', arguments: { count: 3 } });
      expect(replyOf(await cc.callTool({ name: 'get_counter_value', arguments: {} }))).toEqual({
        count: 5,
      });
      // The MCP calls ran on the seeded session: its cookie sees the same counter over HTTP.
      const http = await counter.post(
        '/get_counter_value',
        {},
        { cookie: c.cookie, ...(key ? { key } : {}) },
      );
      expect(http.body).toEqual({ count: 5 });

      const w = await seed(weather, key);
      const wc = await connect(weather, w.tools);
      expect((await wc.listTools()).tools.map((t) => t.name)).toEqual(['get_weather']);
      const forecast = await wc.callTool({ name: 'get_weather', arguments: { city: 'Paris' } });
      expect(replyOf(forecast)).toEqual({ city: 'Paris', forecast: 'sunny' });
      const bad = await wc.callTool({ name: 'get_weather', arguments: {} });
      expect(bad.isError).toBe(true);
      expect(replyOf(bad)).toMatchObject({ error: { code: 'invalid_request' } });

      for (const route of [
        'seed_session',
        'verify',
        'close_session',
        'aggregate_metrics',
        'prepare',
        'ng-control/v1/prepare',
      ]) {
        await expect(wc.callTool({ name: route, arguments: {} })).rejects.toThrow(/unknown tool/);
      }
    },
  );
});
