/** Test harness: a fake backend, a policy model server in front of it, control calls over HTTP. */
import { once } from 'node:events';
import { mkdtemp, rm } from 'node:fs/promises';
import { createServer, request as httpRequest, type IncomingMessage } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import {
  type ListeningServer,
  type Logger,
  listen,
  parseStackFile,
  serverSettings,
} from '@ckpt-gym/core/server';
import { type RunningFakeInference, startFakeInference } from '@ckpt-gym/fake-inference';
import { closeNow, controlClient, type ControlReply } from '@ckpt-gym/testing';

import type { CutRecord } from '../src/cuts.js';
import { createPolicyModelServer, type PolicyModelServer } from '../src/index.js';

export const TOKEN = 'tok';

export interface StackOptions {
  checkpoint?: boolean;
  policy?: boolean;
  capture?: boolean;
  /** Shared capture directory (default: a fresh temporary one). */
  captureDir?: string;
  backendUrl?: string;
  extra?: string;
  /** The server's logger (default: a silent one). */
  logger?: Logger;
}

export function stackYaml(backendUrl: string, dir: string, opts: StackOptions = {}): string {
  return [
    `checkpoint: { enabled: ${opts.checkpoint ?? true}, control_auth_token: ${TOKEN} }`,
    `token_capture: { enabled: ${opts.capture ?? true}, dir: ${JSON.stringify(dir)} }`,
    'servers:',
    `  policy: { kind: model, app: policy, port: 0, backend_url: ${JSON.stringify(backendUrl)}, ` +
      `checkpoint_policy: ${opts.policy ?? true}${opts.extra ?? ''} }`,
  ].join('\n');
}

export interface Harness {
  fake: RunningFakeInference;
  server: PolicyModelServer;
  listening: ListeningServer;
  url: string;
  captureDir: string;
  close(): Promise<void>;
}

const cleanups: (() => Promise<void>)[] = [];

/** Runs every registered cleanup (call in afterEach). */
export async function cleanup(): Promise<void> {
  while (cleanups.length > 0) await cleanups.pop()!();
}

export async function tempDir(): Promise<string> {
  const dir = await mkdtemp(join(tmpdir(), 'policy-model-'));
  cleanups.push(() => rm(dir, { recursive: true, force: true }));
  return dir;
}

export async function startFake(keepAliveMs = 0): Promise<RunningFakeInference> {
  const fake = await startFakeInference({ port: 0, keepAliveMs });
  cleanups.push(async () => {
    fake.server.closeAllConnections();
    await fake.close();
  });
  return fake;
}

/** A policy model server on port 0 in front of `fake` (or a fresh fake backend). */
export async function startHarness(
  opts: StackOptions & { fake?: RunningFakeInference } = {},
): Promise<Harness> {
  const fake = opts.fake ?? (await startFake());
  const captureDir = opts.captureDir ?? (await tempDir());
  const stack = parseStackFile(stackYaml(opts.backendUrl ?? `${fake.url}/v1`, captureDir, opts));
  const server = await createPolicyModelServer(serverSettings(stack, 'policy'), stack, {
    logger: opts.logger ?? silentLogger(),
  });
  const listening = await listen(server.app, 0);
  const close = () => closeNow(listening);
  cleanups.push(close);
  return { fake, server, listening, url: listening.url, captureDir, close };
}

/** A logger that keeps quiet (tests assert on behaviour, not on logs). */
export function silentLogger(): Logger {
  const logger: Logger = {
    error: () => undefined,
    warn: () => undefined,
    info: () => undefined,
    debug: () => undefined,
    child: () => logger,
  };
  return logger;
}

export interface LogLine {
  level: 'error' | 'warn' | 'info' | 'debug';
  message: string;
  meta: Record<string, unknown> | undefined;
}

/** A logger that keeps every line it is given, for the tests that check what a server logged. */
export function recordingLogger(): { logger: Logger; lines: LogLine[] } {
  const lines: LogLine[] = [];
  const at =
    (level: LogLine['level']) =>
    (message: string, meta?: Record<string, unknown>): void =>
      void lines.push({ level, message, meta });
  const logger: Logger = {
    error: at('error'),
    warn: at('warn'),
    info: at('info'),
    debug: at('debug'),
    child: () => logger,
  };
  return { logger, lines };
}

/** Counts the requests the policy server receives for `path`, so a test sees what a client resent. */
export function countRequests(h: Harness, path: string): () => number {
  let count = 0;
  // Before the app's own listener: express rewrites `req.url` as it routes.
  h.listening.server.prependListener('request', (req: IncomingMessage) => {
    if (new URL(req.url ?? '/', h.url).pathname === path) count += 1;
  });
  return () => count;
}

/** A loopback port nothing listens on (bound, then closed, at run time). */
export async function closedPort(): Promise<number> {
  const server = createServer();
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  const { port } = server.address() as AddressInfo;
  await new Promise((done) => server.close(done));
  return port;
}

export interface Reply {
  status: number;
  headers: Headers;
  body: unknown;
}

export async function post(
  url: string,
  body: unknown,
  headers: Record<string, string> = {},
): Promise<Reply> {
  const res = await fetch(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: JSON.stringify(body),
  });
  const text = await res.text();
  let parsed: unknown = text;
  try {
    parsed = JSON.parse(text);
  } catch {
    // an event stream or plain text stays text
  }
  return { status: res.status, headers: res.headers, body: parsed };
}

export const CHAT_BODY = { model: 'fake-model', messages: [{ role: 'user', content: 'weather?' }] };

/** A chat call through the proxy for `key` (undefined = untagged). */
export function chat(
  url: string,
  key: string | undefined,
  body: object = CHAT_BODY,
): Promise<Reply> {
  const prefix = key === undefined ? '' : `/ng-rollout/${key}`;
  return post(`${url}${prefix}/v1/chat/completions`, body);
}

/** A checkpoint control call, whatever the reply's status. */
export async function control(url: string, route: string, body: object): Promise<ControlReply> {
  await using client = controlClient(url, TOKEN);
  return client.post(route, body as Record<string, unknown>);
}

export async function fakeCalls(fake: RunningFakeInference): Promise<Record<string, unknown>[]> {
  const res = await fetch(`${fake.url}/_ctl/calls`);
  return ((await res.json()) as { calls: Record<string, unknown>[] }).calls;
}

export async function fakeCtl(
  fake: RunningFakeInference,
  route: string,
  body: object = {},
): Promise<unknown> {
  return (await post(`${fake.url}/_ctl/${route}`, body)).body;
}

/**
 * A raw HTTP call that records when the response head arrives, so a test can tell that nothing
 * (not even the status line) was written.
 */
export function rawCall(url: string, path: string, body: object) {
  const state: { head: IncomingMessage | undefined; text: string; done: boolean } = {
    head: undefined,
    text: '',
    done: false,
  };
  const target = new URL(path, url);
  const req = httpRequest(target, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
  });
  const finished = new Promise<void>((resolve, reject) => {
    req.on('response', (res) => {
      state.head = res;
      res.setEncoding('utf8');
      res.on('data', (chunk: string) => (state.text += chunk));
      res.on('end', () => {
        state.done = true;
        resolve();
      });
      res.on('error', reject);
    });
    req.on('error', reject);
  });
  finished.catch(() => undefined);
  req.end(JSON.stringify(body));
  return { state, finished, abort: () => req.destroy() };
}

/** A generation-cut record as a checkpoint holds one (its continuation is the wire model). */
export const CUT_RECORD: CutRecord = {
  capture_key: 'r',
  model_call_id: 'c2',
  request_digest: 'd',
  admitted_at: 1,
  cut_id: 'cut',
  continuation: {
    schema_version: 2,
    source_capture_key: 'r',
    source_model_call_id: 'c2',
    staging_keys: ['k'],
    prefix_token_count: 2,
    prefix_digest: 'a'.repeat(64),
    effective_output_limit: 1024,
  },
};
