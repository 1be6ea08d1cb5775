/**
 * MCP exposure with the official MCP client (`Client` over `StreamableHTTPClientTransport`)
 * against real servers on free ports: the tools and nothing else, the session token that names
 * its attempt, and the checkpoint semantics of the one POST that carries each tool call.
 */
import type { JsonObject } from '@ckpt-gym/core/protocol';
import { Gate, until } from '@ckpt-gym/testing';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import type { CallToolResult } from '@modelcontextprotocol/sdk/types.js';

import {
  counterServer,
  McpTokens,
  mcpTokenKey,
  sessionSecret,
  weatherServer,
} from '../src/index.js';
import { probeServer } from './probe.js';
import {
  checkpoint,
  cleanUp,
  episodeJson,
  restore,
  startServer,
  tempDir,
  type TestServer,
  TOKEN,
  track,
} from './support.js';

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

const soon = (): number => Date.now() / 1000 + 30;
/** A deadline just ahead: prepare answers almost at once with the current report. */
const brief = (): number => Date.now() / 1000 + 0.05;
let ids = 0;
const opId = (): string => `op-${++ids}`;

/** The HTTP status and body text of an MCP POST the server refused. */
async function refusal(call: Promise<unknown>): Promise<{ code: number; message: string }> {
  try {
    await call;
  } catch (err) {
    return { code: (err as { code: number }).code, message: (err as Error).message };
  }
  throw new Error('the call was not refused');
}

/** The claims of an MCP token, read without its signature. */
function claimsOf(tools: JsonObject): JsonObject {
  const bearer = (tools.headers as Record<string, string>).Authorization as string;
  const payload = bearer.replace(/^Bearer /, '').split('.')[0] as string;
  return JSON.parse(Buffer.from(payload, 'base64url').toString('utf8')) as JsonObject;
}

/** The grant of a token minted with the server's key, for a session and an attempt of our choice. */
function forgedGrant(sessionId: string, tools: string[], episode?: string): JsonObject {
  const key = mcpTokenKey(sessionSecret({ controlAuthToken: TOKEN, serverName: 'res' }));
  const token = new McpTokens(key).mint(
    sessionId,
    tools,
    episode === undefined ? undefined : { rollout_id: episode, attempt: 0 },
  );
  return { url_path: '/mcp', headers: { Authorization: `Bearer ${token}` } };
}

function retire(server: TestServer, keys: string[]) {
  return server.control('retire', {
    checkpoint_id: opId(),
    deadline_ts: soon(),
    episode_ids: keys.map(episodeJson),
  });
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

describe('MCP session tokens', () => {
  test('a token minted with checkpointing names the attempt that seeded it; without, only its session and tools', async () => {
    const on = await startServer(counterServer(), { mcp: true });
    const onClaims = claimsOf((await seed(on, 'r7-a2')).tools);
    expect(onClaims).toEqual({
      session_id: expect.any(String),
      tools: ['increment_counter', 'get_counter_value'],
      episode: 'r7-a2',
    });
    const off = await startServer(counterServer(), { mcp: true, checkpoint: false });
    expect(Object.keys(claimsOf((await seed(off, 'r7-a2')).tools)).sort()).toEqual([
      'session_id',
      'tools',
    ]);
  });

  test("the token key is deterministic: a second process with the same secret reads the first one's token", async () => {
    const first = await startServer(counterServer(), {
      mcp: true,
      checkpoint: false,
      sessionSecret: 's',
    });
    const second = await startServer(counterServer(), {
      mcp: true,
      checkpoint: false,
      sessionSecret: 's',
    });
    const { tools } = await seed(first, undefined);
    const client = await connect(second, tools);
    expect((await client.listTools()).tools).toHaveLength(2);
  });

  test('a batch of JSON-RPC messages is refused 422, and GET /mcp is 405', async () => {
    const server = await startServer(counterServer(), { mcp: true });
    const { tools } = await seed(server, 'r1');
    const headers = tools.headers as Record<string, string>;
    const call = {
      jsonrpc: '2.0',
      id: 1,
      method: 'tools/call',
      params: { name: 'get_counter_value' },
    };
    const batch = await server.post('/mcp', [call, { ...call, id: 2 }], {
      headers: { ...headers, accept: 'application/json, text/event-stream' },
    });
    expect(batch.status).toBe(422);
    expect(batch.body.error).toMatchObject({ code: 'invalid_request' });
    const get = await fetch(`${server.url}/mcp`, { headers });
    expect([get.status, get.headers.get('allow')]).toEqual([405, 'POST']);
  });

  test('a call without a valid token is refused 401 unauthorized', async () => {
    const server = await startServer(counterServer(), { mcp: true });
    const forged = { url_path: '/mcp', headers: { Authorization: 'Bearer bm9wZQ.bm9wZQ' } };
    const refused = await refusal(connect(server, forged));
    expect(refused.code).toBe(401);
    expect(refused.message).toContain('unauthorized');
  });

  test("with checkpointing on, a token that names no attempt, or another attempt than the session's, is refused stale_attempt before its tool runs", async () => {
    const probe = probeServer();
    const server = await startServer(probe, { mcp: true });
    await seed(server, 'r1');
    const sessionId = [...probe.values.keys()][0] as string;
    for (const grant of [
      forgedGrant(sessionId, ['bump']),
      forgedGrant(sessionId, ['bump'], 'r2'),
    ]) {
      const client = await connect(server, grant);
      const refused = await refusal(client.callTool({ name: 'bump', arguments: {} }));
      expect(refused.code).toBe(409);
      expect(refused.message).toContain('stale_attempt');
    }
    expect(probe.calls.tool).toBe(0);
    const own = await connect(server, forgedGrant(sessionId, ['bump'], 'r1'));
    expect(replyOf(await own.callTool({ name: 'bump', arguments: {} }))).toEqual({ value: 1 });
  });
});

describe('checkpoints and MCP tool calls', () => {
  test('a tool call made while a checkpoint is open waits, runs after resume, and the checkpoint holds the state from before it; a replayable /verify is admitted at once', async () => {
    const probe = probeServer('exported', 'replay');
    const server = await startServer(probe, { mcp: true });
    const { cookie, tools } = await seed(server, 'r1');
    const client = await connect(server, tools);
    await client.callTool({ name: 'bump', arguments: {} });
    expect((await server.ok('prepare', { checkpoint_id: 'c1' })).phase).toBe('prepared');

    const call = track(client.callTool({ name: 'bump', arguments: {} }));
    await until(() => server.participant.readiness().counts.waiting === 1, 'the call to wait');
    const headers = { 'x-ng-checkpoint-close-follows': '1' };
    const verified = await server.post('/verify', {}, { cookie, key: 'r1', headers });
    expect(verified.status).toBe(200);
    const dir = await tempDir();
    await server.ok('commit', {
      checkpoint_id: 'c1',
      checkpoint_dir: dir,
      episode_ids: [episodeJson('r1')],
    });
    expect(probe.calls.tool).toBe(1);
    expect(call.done).toBe(false);

    await server.ok('resume', { checkpoint_id: 'c1' });
    expect(replyOf(await call.promise)).toEqual({ value: 2 });
    const fresh = probeServer('exported', 'replay');
    await restore(await startServer(fresh, { mcp: true }), 'c2', dir, ['r1']);
    expect([...fresh.values.values()]).toEqual([1]);
  });

  test('a tool call in flight holds up prepare', async () => {
    const probe = probeServer();
    const server = await startServer(probe, { mcp: true });
    const client = await connect(server, (await seed(server, 'r1')).tools);
    probe.gates.tool = new Gate();
    const call = track(client.callTool({ name: 'bump', arguments: {} }));
    await until(() => probe.calls.tool === 1, 'the tool to run');
    const blocked = await server.control('prepare', { checkpoint_id: 'c1', deadline_ts: brief() });
    expect(blocked.body).toMatchObject({ report: { ready: false, blockers: ['r1'] } });
    probe.gates.tool.open();
    expect(replyOf(await call.promise)).toEqual({ value: 1 });
    await server.ok('resume', { checkpoint_id: 'c1' });
    const prepared = await server.ok('prepare', { checkpoint_id: 'c2', deadline_ts: soon() });
    expect(prepared).toMatchObject({ phase: 'prepared', report: { ready: true } });
  });

  test('a retire drains an MCP call in flight and refuses the next one', async () => {
    const probe = probeServer();
    const server = await startServer(probe, { mcp: true });
    const client = await connect(server, (await seed(server, 'r1')).tools);
    const sessionId = [...probe.values.keys()][0] as string;
    probe.gates.tool = new Gate();
    const call = track(client.callTool({ name: 'bump', arguments: {} }));
    await until(() => probe.calls.tool === 1, 'the tool to run');
    const retiring = track(retire(server, ['r1']));
    await until(() => !server.participant.isOpen(sessionId), 'the fence');
    expect(probe.calls.retired).toEqual([]);
    expect(retiring.done).toBe(false);

    probe.gates.tool.open();
    expect(replyOf(await call.promise)).toEqual({ value: 1 });
    expect((await retiring.promise).status).toBe(200);
    expect(probe.calls.retired).toEqual([sessionId]);
    const refused = await refusal(client.callTool({ name: 'bump', arguments: {} }));
    expect(refused.code).toBe(409);
    expect(refused.message).toContain('stale_attempt');
    expect(probe.calls.tool).toBe(1);
  });

  test("after a restore the replaced attempt's token is refused stale_attempt before its tool runs, and a seed of the replacement with the session's cookie gets a token that continues the restored counter", async () => {
    const first = await startServer(counterServer(), { mcp: true });
    const seeded = await seed(first, 'r1', { initial_count: 0 });
    const old = await connect(first, seeded.tools);
    await old.callTool({ name: 'increment_counter', arguments: { count: 3 } });
    const dir = await checkpoint(first, 'c1', ['r1']);
    await first.close();

    const counter = counterServer();
    const second = await startServer(counter, { mcp: true });
    await restore(second, 'c2', dir, ['r1']);
    const stale = await connect(second, seeded.tools);
    const refused = await refusal(
      stale.callTool({ name: 'increment_counter', arguments: { count: 9 } }),
    );
    expect(refused.code).toBe(409);
    expect(refused.message).toContain('stale_attempt');
    expect([...counter.counters.values()]).toEqual([3]);
    expect(second.participant.restoredPending()).toEqual([{ rollout_id: 'r1', attempt: 1 }]);

    const replacement = await seed(second, 'r1-a1', { initial_count: 0 }, seeded.cookie);
    expect(claimsOf(replacement.tools).episode).toBe('r1-a1');
    const fresh = await connect(second, replacement.tools);
    expect(replyOf(await fresh.callTool({ name: 'get_counter_value', arguments: {} }))).toEqual({
      count: 3,
    });
    await fresh.callTool({ name: 'increment_counter', arguments: { count: 2 } });
    const verified = await second.post(
      '/verify',
      { expected_count: 5 },
      { cookie: seeded.cookie, key: 'r1-a1' },
    );
    expect(verified.body.reward).toBe(1);
    const still = await refusal(stale.callTool({ name: 'get_counter_value', arguments: {} }));
    expect(still.message).toContain('stale_attempt');
  });

  test('a stale harness cannot create state for a session the fresh process never saw', async () => {
    const first = await startServer(probeServer('stateless'), { mcp: true });
    const { tools } = await seed(first, 'r1');
    const dir = await checkpoint(first, 'c1', ['r1']);
    await first.close();

    const probe = probeServer('stateless');
    const second = await startServer(probe, { mcp: true });
    await restore(second, 'c2', dir, ['r1']);
    const stale = await connect(second, tools);
    const refused = await refusal(stale.callTool({ name: 'bump', arguments: {} }));
    expect(refused.code).toBe(409);
    expect(refused.message).toContain('stale_attempt');
    expect(probe.calls.tool).toBe(0);
    expect(probe.values.size).toBe(0);
  });

  test("a second restore refuses the first replacement's token", async () => {
    const first = await startServer(counterServer(), { mcp: true });
    const seeded = await seed(first, 'r1');
    await (
      await connect(first, seeded.tools)
    ).callTool({ name: 'increment_counter', arguments: {} });
    const dir1 = await checkpoint(first, 'c1', ['r1']);
    await first.close();

    const second = await startServer(counterServer(), { mcp: true });
    await restore(second, 'c2', dir1, ['r1']);
    const replacement = await seed(second, 'r1-a1', {}, seeded.cookie);
    const a1 = await connect(second, replacement.tools);
    await a1.callTool({ name: 'increment_counter', arguments: {} });
    const dir2 = await checkpoint(second, 'c3', ['r1-a1']);
    await second.close();

    const counter = counterServer();
    const third = await startServer(counter, { mcp: true });
    await restore(third, 'c4', dir2, ['r1-a1']);
    for (const grant of [seeded.tools, replacement.tools]) {
      const stale = await connect(third, grant);
      const refused = await refusal(stale.callTool({ name: 'increment_counter', arguments: {} }));
      expect(refused.message).toContain('stale_attempt');
    }
    expect([...counter.counters.values()]).toEqual([2]);
    const a2 = await connect(third, (await seed(third, 'r1-a2', {}, seeded.cookie)).tools);
    expect(replyOf(await a2.callTool({ name: 'get_counter_value', arguments: {} }))).toEqual({
      count: 2,
    });
  });
});
