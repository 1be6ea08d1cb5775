/**
 * Starts a Simple Agent server (with or without checkpointing) against the stub model and
 * resources servers, and speaks to it over HTTP: seeds, activations, closes and control calls.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { createLogger, listen, type ListeningServer } from '@ckpt-gym/core/server';
import {
  closeNow,
  controlClient,
  type ControlReply,
  deadline,
  startStubModel,
  startStubToolResources,
  type StubModel,
  type StubToolResources,
} from '@ckpt-gym/testing';

import { type AgentServer, createAgentServer } from '../../src/app.js';
import type { AgentDefinition } from '../../src/agent.js';
import { simpleAgent, type SimpleSessionState } from '../../src/simple-agent.js';

export const TOKEN = 'tok';
export const CHECKPOINT = {
  enabled: true as const,
  controlAuthToken: TOKEN,
  leaseGraceSeconds: 600,
};

export interface Harness<S = SimpleSessionState> extends AsyncDisposable {
  model: StubModel;
  resources: StubToolResources;
  agent: AgentServer<S>;
  server: ListeningServer;
  url: string;
  dir: string;
  close(): Promise<void>;
}

const quiet = () => createLogger({ server: 'agent', kind: 'agent', level: 'error' });

/** A fresh agent process (a restore needs one) sharing the same stubs. */
export async function startAgent<S = SimpleSessionState>(
  base: { model: StubModel; resources: StubToolResources; dir: string },
  options: {
    checkpoint?: boolean;
    definition?: AgentDefinition<S>;
    config?: Record<string, unknown>;
  } = {},
): Promise<Harness<S>> {
  const definition = (options.definition ?? simpleAgent) as AgentDefinition<S>;
  const agent = createAgentServer(definition, {
    name: 'simple_agent',
    checkpoint: options.checkpoint === false ? undefined : CHECKPOINT,
    config: {
      model_server_url: base.model.url,
      resources_server_url: base.resources.url,
      ...options.config,
    },
    logger: quiet(),
  });
  const server = await listen(agent.app, 0);
  const harness: Harness<S> = {
    ...base,
    agent,
    server,
    url: server.url,
    async close() {
      // A torn-down process: connections a test abandoned mid-request end with it.
      await closeNow(server);
      agent.close();
    },
    [Symbol.asyncDispose]: () => harness.close(),
  };
  return harness;
}

export async function startStack<S = SimpleSessionState>(
  options: Parameters<typeof startAgent<S>>[1] & { verifyMode?: 'wait' | 'replay' } = {},
): Promise<Harness<S>> {
  const model = await startStubModel();
  const resources = await startStubToolResources({ verifyMode: options.verifyMode });
  const dir = await mkdtemp(join(tmpdir(), 'agent-server-'));
  const h = await startAgent<S>({ model, resources, dir }, options);
  const stack: Harness<S> = {
    ...h,
    async close() {
      await h.close();
      await model.close();
      await resources.close();
      await rm(dir, { recursive: true, force: true });
    },
    [Symbol.asyncDispose]: () => stack.close(),
  };
  return stack;
}

export interface Reply {
  status: number;
  body: Record<string, unknown>;
  headers: Headers;
  /** `name=value` pairs the reply set. */
  cookies: Record<string, string>;
}

export async function post(
  url: string,
  body: unknown,
  headers: Record<string, string> = {},
  signal?: AbortSignal,
): Promise<Reply> {
  const res = await fetch(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: JSON.stringify(body),
    ...(signal ? { signal } : {}),
  });
  const text = await res.text();
  const cookies: Record<string, string> = {};
  for (const line of res.headers.getSetCookie()) {
    const pair = line.split(';', 1)[0]!;
    const eq = pair.indexOf('=');
    cookies[pair.slice(0, eq)] = decodeURIComponent(pair.slice(eq + 1));
  }
  return {
    status: res.status,
    body: text ? (JSON.parse(text) as Record<string, unknown>) : {},
    headers: res.headers,
    cookies,
  };
}

export function errorCode(reply: { body: Record<string, unknown> }): string | undefined {
  return (reply.body.error as { code?: string } | undefined)?.code;
}

export function weatherAccess(resourcesUrl: string, key: string) {
  return {
    kind: 'direct_http',
    name: 'weather',
    required: true,
    base_url: `${resourcesUrl}/ng-rollout/${key}`,
    cookies: { res_session: 'seeded' },
    headers: {},
  };
}

export interface Seeded {
  id: string;
  cookie: string;
}

/** Seeds a session for capture key `key` (rollout `rollout`, attempt `attempt`). */
export async function seed(
  h: { url: string; resources: { url: string } },
  id: string,
  rollout: string,
  options: { attempt?: number; tools?: unknown[]; signal?: AbortSignal } = {},
): Promise<Seeded & { reply: Reply }> {
  const attempt = options.attempt ?? 0;
  const key = attempt === 0 ? rollout : `${rollout}-a${attempt}`;
  const reply = await post(
    `${h.url}/ng-rollout/${key}/v1/agent_sessions`,
    {
      agent_session_id: id,
      episode_id: { rollout_id: rollout, attempt },
      task_id: 't1',
      tool_accesses: options.tools ?? [weatherAccess(h.resources.url, key)],
      sandbox_access: null,
    },
    {},
    options.signal,
  );
  return {
    id,
    cookie: `agent_session_id=${encodeURIComponent(reply.cookies.agent_session_id ?? '')}`,
    reply,
  };
}

export function activate(
  h: { url: string },
  session: Seeded,
  key: string | null,
  index?: number,
  signal?: AbortSignal,
): Promise<Reply> {
  const prefix = key === null ? '' : `/ng-rollout/${key}`;
  return post(
    `${h.url}${prefix}/v1/responses`,
    {
      input: 'What is the weather in SF?',
      tools: [{ type: 'function', name: 'get_weather', parameters: {} }],
    },
    {
      cookie: session.cookie,
      ...(index === undefined ? {} : { 'x-ng-agent-activation': String(index) }),
    },
    signal,
  );
}

export function closeSession(
  h: { url: string },
  session: Seeded,
  episode?: { rollout_id: string; attempt: number },
  signal?: AbortSignal,
): Promise<Reply> {
  return post(
    `${h.url}/v1/agent_sessions/close`,
    { agent_session_id: session.id, ...(episode ? { episode_id: episode } : {}) },
    { cookie: session.cookie },
    signal,
  );
}

// --- control ---------------------------------------------------------------------------------

/** A control call with a 30 s deadline unless `body` names one; the reply has any status. */
export async function control(
  h: { url: string },
  route: string,
  body: Record<string, unknown>,
): Promise<ControlReply> {
  await using client = controlClient(h.url, TOKEN);
  return client.post(route, { deadline_ts: deadline(), ...body });
}

// --- checkpoint flows --------------------------------------------------------------------------

export interface PrepareResult {
  phase: string;
  report: {
    ready: boolean;
    blockers: string[];
    restarts: string[];
    counts: Record<string, number>;
  };
}

export async function prepare(
  h: { url: string },
  id: string,
  options: { restarts?: string[]; seconds?: number } = {},
): Promise<PrepareResult> {
  const reply = await control(h, 'prepare', {
    checkpoint_id: id,
    deadline_ts: deadline(options.seconds ?? 30),
    ...(options.restarts ? { restarts: options.restarts } : {}),
  });
  if (reply.status !== 200)
    throw new Error(`prepare: ${reply.status} ${JSON.stringify(reply.body)}`);
  return reply.body as unknown as PrepareResult;
}

export async function commit(
  h: { url: string; dir: string },
  id: string,
  scope: { rollout_id: string; attempt: number }[] | null,
): Promise<string[]> {
  const reply = await control(h, 'commit', {
    checkpoint_id: id,
    checkpoint_dir: join(h.dir, id),
    episode_ids: scope,
  });
  if (reply.status !== 200)
    throw new Error(`commit: ${reply.status} ${JSON.stringify(reply.body)}`);
  return reply.body.episode_ids as string[];
}

export async function resume(h: { url: string }, id: string): Promise<void> {
  const reply = await control(h, 'resume', { checkpoint_id: id });
  if (reply.status !== 200)
    throw new Error(`resume: ${reply.status} ${JSON.stringify(reply.body)}`);
}

export async function restore(
  h: { url: string; dir: string },
  id: string,
  scope: { rollout_id: string; attempt: number }[],
  from = id,
): Promise<ControlReply> {
  return control(h, 'restore', {
    checkpoint_id: id,
    checkpoint_dir: join(h.dir, from),
    episode_ids: scope,
  });
}

export async function retire(
  h: { url: string },
  episodes: { rollout_id: string; attempt: number }[],
  seconds = 30,
  checkpointId = `retire-${Math.random().toString(36).slice(2)}`,
): Promise<ControlReply> {
  return control(h, 'retire', {
    checkpoint_id: checkpointId,
    deadline_ts: deadline(seconds),
    episode_ids: episodes,
  });
}
