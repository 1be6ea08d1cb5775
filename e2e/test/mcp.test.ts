/**
 * Tools over MCP in real processes: a whole counter rollout whose agent takes its tools over MCP,
 * and an MCP-driven counter rollout (a harness calling the counter's tools with the official MCP
 * client and its session token) crashed mid-flight, restored and resumed: the replaced attempt's
 * token is refused before its tool runs, and the replacement re-seeds for a token of its own and
 * continues from the restored counter.
 */
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import {
  StreamableHTTPClientTransport,
  StreamableHTTPError,
} from '@modelcontextprotocol/sdk/client/streamableHttp.js';

import { ep } from '@ckpt-gym/testing';

import { closeAll, Deployment, type Json, scenario } from './support/deployment.js';
import { counterEpisode } from './support/stacks.js';

afterEach(closeAll);

const TASK_DATA = { initial_count: 3, expected_count: 6 };

/** A native resources call under `key`'s rollout prefix; the reply's cookie and body. */
async function resourcesCall(
  dep: Deployment,
  key: string,
  path: string,
  body: Json,
  cookie?: string,
): Promise<{ status: number; body: Json; cookie: string | undefined }> {
  const res = await fetch(`${dep.url('counter')}/ng-rollout/${key}${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...(cookie ? { cookie } : {}) },
    body: JSON.stringify(body),
  });
  const set = res.headers.getSetCookie()[0]?.split(';', 1)[0];
  return { status: res.status, body: (await res.json()) as Json, cookie: set ?? cookie };
}

/** Seeds (or re-seeds, with its cookie) the counter session for attempt `attempt`. */
async function seedCounter(dep: Deployment, attempt: number, cookie?: string) {
  const key = attempt === 0 ? 'counter-1' : `counter-1-a${attempt}`;
  const reply = await resourcesCall(
    dep,
    key,
    '/seed_session',
    {
      resources_session_id: 'mcp-counter-session',
      episode_id: { rollout_id: 'counter-1', attempt },
      task_id: { taskset: 'example_session_state_mgmt:e2e', task_id: 'counter-3-6' },
      task_data: TASK_DATA,
    },
    cookie,
  );
  expect(reply.status).toBe(200);
  const tools = reply.body.resources_tools as { url_path: string; headers: Record<string, string> };
  return { key, cookie: reply.cookie!, tools };
}

/** An MCP client of the counter with a seed's token. */
async function mcpClient(
  dep: Deployment,
  tools: { url_path: string; headers: Record<string, string> },
) {
  const client = new Client({ name: 'e2e-harness', version: '0.1.0' });
  const url = new URL(`${dep.url('counter')}${tools.url_path}`);
  await client.connect(
    new StreamableHTTPClientTransport(url, { requestInit: { headers: tools.headers } }),
  );
  return client;
}

async function increment(client: Client, count: number): Promise<void> {
  const result = await client.callTool({ name: 'increment_counter', arguments: { count } });
  expect(result.isError).toBeFalsy();
}

async function counterValue(client: Client): Promise<number> {
  const result = await client.callTool({ name: 'get_counter_value', arguments: {} });
  const [content] = result.content as { type: string; text: string }[];
  return (JSON.parse(content!.text) as { count: number }).count;
}

scenario('a whole counter rollout runs with its tools over MCP', async () => {
  const dep = await Deployment.start('counter', { tools: 'mcp' });
  const reply = await dep.post('env', '/run', counterEpisode('counter-1')).reply;
  expect(reply.status).toBe(200);
  expect(reply.body.failure).toBeNull();
  expect(reply.body.result).toMatchObject({ reward: 1, count: 6 });
});

scenario(
  'crash with an MCP-driven counter rollout in flight: the old token is refused, the replacement re-seeds and continues',
  async () => {
    const dep = await Deployment.start('counter', { tools: 'mcp' });
    const first = await seedCounter(dep, 0);
    const old = await mcpClient(dep, first.tools);
    await increment(old, 1); // 4: the rollout is mid-flight, its second increment still to come
    await old.close();

    const { committed } = await dep.checkpoint('c1', [ep('counter-1')]);
    expect(committed.counter?.episode_ids).toEqual(['counter-1']);
    await dep.crashAndRestore('c1', [ep('counter-1')]);

    // The replaced attempt's harness keeps its token: refused before the tool runs.
    const stale = await mcpClient(dep, first.tools);
    const refused = await increment(stale, 100).then(
      () => null,
      (err: unknown) => err,
    );
    await stale.close();
    expect(refused).toBeInstanceOf(StreamableHTTPError);
    expect((refused as StreamableHTTPError).code).toBe(409);
    expect((refused as Error).message).toContain('stale_attempt');

    // The replacement seeds under its own attempt with the session's cookie: a new token.
    const next = await seedCounter(dep, 1, first.cookie);
    expect(next.tools.headers.Authorization).not.toBe(first.tools.headers.Authorization);
    const client = await mcpClient(dep, next.tools);
    expect(await counterValue(client)).toBe(4); // the restored counter, the stale +100 never ran
    await increment(client, 2);
    await client.close();

    const verified = await resourcesCall(
      dep,
      next.key,
      '/verify',
      { ...TASK_DATA, responses_create_params: {}, response: {} },
      next.cookie,
    );
    expect(verified.status).toBe(200);
    expect(verified.body).toMatchObject({ reward: 1 });
  },
);
