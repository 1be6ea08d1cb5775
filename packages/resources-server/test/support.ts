/**
 * Test harness: a resources server on a real port, a small HTTP client that keeps the session
 * cookie, the control routes, and gates that hold a handler until the test opens them.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { type JsonObject } from '@ckpt-gym/core/protocol';
import { listen, type ListeningServer, type Logger, type LogMeta } from '@ckpt-gym/core/server';

import {
  closeNow,
  type ControlClient,
  controlClient,
  type ControlReply,
  ep,
} from '@ckpt-gym/testing';

import {
  createResourcesServer,
  type ResourcesServer,
  type ResourcesServerDefinition,
} from '../src/index.js';

export const TOKEN = 'tok';

export class SilentLogger implements Logger {
  readonly lines: { level: string; message: string; meta: LogMeta }[] = [];
  error(message: string, meta: LogMeta = {}): void {
    this.lines.push({ level: 'error', message, meta });
  }
  warn(message: string, meta: LogMeta = {}): void {
    this.lines.push({ level: 'warn', message, meta });
  }
  info(): void {}
  debug(): void {}
  child(): Logger {
    return this;
  }
}

export interface Reply {
  status: number;
  body: JsonObject;
  headers: Headers;
  /** The session cookie the reply set, if any (`name=value`). */
  setCookie: string | undefined;
}

export interface CallOptions {
  /** Capture key for the `/ng-rollout/<key>` prefix. */
  key?: string;
  cookie?: string;
  headers?: Record<string, string>;
  signal?: AbortSignal;
}

export class TestServer implements AsyncDisposable {
  readonly aborts = new Set<AbortController>();
  readonly controller: ControlClient;

  constructor(
    readonly built: ResourcesServer,
    readonly listening: ListeningServer,
    readonly logger: SilentLogger,
  ) {
    this.controller = controlClient(listening.url, TOKEN);
  }

  get url(): string {
    return this.listening.url;
  }

  get participant() {
    const participant = this.built.participant;
    if (!participant) throw new Error('checkpointing is off');
    return participant;
  }

  async post(path: string, body: unknown = {}, options: CallOptions = {}): Promise<Reply> {
    const prefix = options.key === undefined ? '' : `/ng-rollout/${options.key}`;
    const abort = new AbortController();
    this.aborts.add(abort);
    const signal = options.signal ? AbortSignal.any([abort.signal, options.signal]) : abort.signal;
    try {
      const res = await fetch(`${this.url}${prefix}${path}`, {
        method: 'POST',
        headers: {
          'content-type': 'application/json',
          ...(options.cookie ? { cookie: options.cookie } : {}),
          ...options.headers,
        },
        body: JSON.stringify(body),
        signal,
      });
      const text = await res.text();
      const setCookie = res.headers.get('set-cookie')?.split(';')[0];
      return {
        status: res.status,
        body: text ? (JSON.parse(text) as JsonObject) : {},
        headers: res.headers,
        setCookie,
      };
    } finally {
      this.aborts.delete(abort);
    }
  }

  /** Seeds a session (legacy body) under `key` and returns its cookie. */
  async seed(key: string, body: JsonObject = {}, path = '/seed_session'): Promise<string> {
    const reply = await this.post(path, body, { key });
    if (reply.status !== 200 || !reply.setCookie) {
      throw new Error(`seed failed: ${reply.status} ${JSON.stringify(reply.body)}`);
    }
    return reply.setCookie;
  }

  /** A control call (GET for `status`), whatever the reply's status. */
  control(route: string, body: JsonObject = {}): Promise<ControlReply> {
    return route === 'status' ? this.controller.get(route) : this.controller.post(route, body);
  }

  /** Sends a control call that must succeed, with a generous deadline unless given. */
  async ok(route: string, body: JsonObject): Promise<JsonObject> {
    return (await this.controller.ok(route, body)) as JsonObject;
  }

  async close(): Promise<void> {
    for (const abort of this.aborts) abort.abort();
    this.built.plane?.dispose();
    this.controller.close();
    await closeNow(this.listening);
  }

  [Symbol.asyncDispose](): Promise<void> {
    running.delete(this);
    return this.close();
  }
}

export interface StartOptions {
  checkpoint?: boolean;
  name?: string;
  sessionSecret?: string;
  /** `expose_tools_over_mcp`. */
  mcp?: boolean;
}

const running = new Set<TestServer>();
const dirs = new Set<string>();

export async function startServer(
  definition: ResourcesServerDefinition,
  options: StartOptions = {},
): Promise<TestServer> {
  const logger = new SilentLogger();
  const built = createResourcesServer(definition, {
    name: options.name ?? 'res',
    checkpoint:
      options.checkpoint === false
        ? undefined
        : { enabled: true, controlAuthToken: TOKEN, leaseGraceSeconds: 600 },
    logger,
    sessionSecret: options.sessionSecret,
    exposeToolsOverMcp: options.mcp,
  });
  const server = new TestServer(built, await listen(built.app, 0), logger);
  running.add(server);
  return server;
}

export async function tempDir(): Promise<string> {
  const dir = await mkdtemp(join(tmpdir(), 'resources-test-'));
  dirs.add(dir);
  return dir;
}

/** Closes every server and removes every temp dir a test made (call in afterEach). */
export async function cleanUp(): Promise<void> {
  await Promise.all([...running].map((s) => s.close()));
  running.clear();
  await Promise.all([...dirs].map((d) => rm(d, { recursive: true, force: true })));
  dirs.clear();
}

export function episodeJson(key: string): JsonObject {
  const e = ep(key);
  return { rollout_id: e.rollout_id, attempt: e.attempt };
}

/** A response body whose output called `tools`. */
export function responseCalling(...tools: string[]): JsonObject {
  return {
    output: tools.map((name, i) => ({
      type: 'function_call',
      name,
      call_id: `call-${i}`,
      arguments: '{}',
    })),
  };
}

/** A text-only Responses body. */
export function responseSaying(text: string): JsonObject {
  return {
    output: [{ type: 'message', role: 'assistant', content: [{ type: 'output_text', text }] }],
  };
}

/** Settles `promise` into a flag the test can read without awaiting it. */
export function track<T>(promise: Promise<T>): { done: boolean; promise: Promise<T> } {
  const tracked = { done: false, promise };
  promise.then(
    () => {
      tracked.done = true;
    },
    () => {
      tracked.done = true;
    },
  );
  return tracked;
}

/** prepare + commit `keys` into a new directory + resume; returns the directory. */
export async function checkpoint(
  server: TestServer,
  checkpointId: string,
  keys: string[] | null,
): Promise<string> {
  const dir = await tempDir();
  const prepared = await server.ok('prepare', { checkpoint_id: checkpointId });
  expect(prepared.phase).toBe('prepared');
  await server.ok('commit', {
    checkpoint_id: checkpointId,
    checkpoint_dir: dir,
    episode_ids: keys === null ? null : keys.map(episodeJson),
  });
  await server.ok('resume', { checkpoint_id: checkpointId });
  return dir;
}

export async function restore(
  server: TestServer,
  checkpointId: string,
  dir: string,
  keys: string[],
) {
  const reply = await server.ok('restore', {
    checkpoint_id: checkpointId,
    checkpoint_dir: dir,
    episode_ids: keys.map(episodeJson),
  });
  await server.ok('resume', { checkpoint_id: checkpointId });
  return reply;
}
