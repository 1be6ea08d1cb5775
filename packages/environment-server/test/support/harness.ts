/**
 * A real environment server (single_agent_turn over stub agent and resources servers) on port 0,
 * with helpers for `/run` and the control routes.
 */
import { mkdtemp, readdir, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { createHttpClients, type HttpClients } from '@ckpt-gym/core/client';
import { decodeJson } from '@ckpt-gym/core/protocol';
import { listen, type ListeningServer, type Logger } from '@ckpt-gym/core/server';
import {
  closeNow,
  type ControlClient,
  controlClient,
  type ControlReply,
  deadline,
  stubAgent,
  stubResources,
  type StubServer,
} from '@ckpt-gym/testing';
import got, { type Got } from 'got';

import {
  createEnvironmentServer,
  type EnvironmentServer,
  type QueueOptions,
} from '../../src/app.js';
import type { EnvironmentProtocol } from '../../src/protocol.js';
import { SingleAgentTurn, type ToolTransport } from '../../src/single-agent-turn.js';

export const TOKEN = 'tok';

export interface HarnessOptions {
  checkpoint?: boolean;
  queue?: QueueOptions;
  episodeDeadlineSeconds?: number | null;
  cleanupTimeoutSeconds?: number;
  transports?: ToolTransport[];
  /** The data client single_agent_turn uses (default: core's data client). */
  client?: Got;
  legacy?: boolean;
  /** Replaces single_agent_turn. */
  protocol?: EnvironmentProtocol;
  /** The checkpoint directory, owned by the caller (default: a temp dir the harness removes). */
  dir?: string;
  /** The server's logger (default: the server's own). */
  logger?: Logger;
}

export type Reply = ControlReply;

const http = got.extend({ retry: { limit: 0 }, throwHttpErrors: false, responseType: 'json' });

export function runBody(rollout: string, attempt = 0, taskData: Record<string, unknown> = {}) {
  return {
    episode_id: { rollout_id: rollout, attempt },
    task: {
      task_id: { taskset: 'weather', task_id: 't1' },
      task_input: {
        responses_create_params: { input: 'What is the weather in Paris?' },
        task_data: { expected_city: 'Paris', ...taskData },
      },
    },
  };
}

export class Harness implements AsyncDisposable {
  env!: EnvironmentServer;
  listening!: ListeningServer;
  readonly agent: StubServer = stubAgent();
  readonly resources: StubServer = stubResources();
  clients!: HttpClients;
  controller!: ControlClient;
  dir = '';

  constructor(private readonly options: HarnessOptions = {}) {}

  get url(): string {
    return this.listening.url;
  }

  async start(): Promise<this> {
    await this.agent.start();
    await this.resources.start();
    this.dir = this.options.dir ?? (await mkdtemp(join(tmpdir(), 'env-server-')));
    this.clients = createHttpClients();
    const checkpointing = this.options.checkpoint ?? true;
    const protocol =
      this.options.protocol ??
      new SingleAgentTurn({
        agentUrl: this.agent.url,
        resourcesUrl: this.resources.url,
        resourcesName: 'weather',
        client: this.options.client ?? this.clients.data,
        checkpointing,
        ...(this.options.transports ? { toolTransports: this.options.transports } : {}),
      });
    this.env = createEnvironmentServer({
      name: 'env',
      protocol,
      ...(checkpointing
        ? { checkpoint: { enabled: true, controlAuthToken: TOKEN, leaseGraceSeconds: 600 } }
        : {}),
      ...(this.options.queue ? { queue: this.options.queue } : {}),
      episodeDeadlineSeconds: this.options.episodeDeadlineSeconds ?? null,
      cleanupTimeoutSeconds: this.options.cleanupTimeoutSeconds ?? 10,
      ...(this.options.legacy ? { legacy: { defaultTaskset: 'weather' } } : {}),
      ...(this.options.logger ? { logger: this.options.logger } : {}),
    });
    this.listening = await listen(this.env.app, 0);
    this.controller = controlClient(this.listening.url, TOKEN);
    return this;
  }

  async close(): Promise<void> {
    // Release anything parked so no request outlives the test.
    await this.env?.participant?.openAdmission();
    if (this.listening) await closeNow(this.listening);
    this.clients?.close();
    this.controller?.close();
    await this.agent.stop();
    await this.resources.stop();
    if (this.dir && !this.options.dir) await rm(this.dir, { recursive: true, force: true });
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }

  async post(path: string, body: unknown, headers: Record<string, string> = {}): Promise<Reply> {
    const res = await http.post(`${this.url}${path}`, { json: body, headers });
    return { status: res.statusCode, body: res.body as unknown as Record<string, unknown> };
  }

  run(body: unknown): Promise<Reply> {
    return this.post('/run', body);
  }

  /** A `/run` the test does not await; it may be cut off when the server goes away. */
  background(body: unknown): void {
    this.run(body).catch(() => undefined);
  }

  control(route: string, body: Record<string, unknown>): Promise<Reply> {
    return this.controller.post(route, body);
  }

  status(): Promise<Record<string, unknown>> {
    return this.controller.status();
  }

  prepare(id: string, seconds = 30): Promise<Reply> {
    return this.control('prepare', { checkpoint_id: id, deadline_ts: deadline(seconds) });
  }

  commit(id: string, scope: { rollout_id: string; attempt: number }[] | null): Promise<Reply> {
    return this.control('commit', {
      checkpoint_id: id,
      deadline_ts: deadline(),
      checkpoint_dir: this.checkpointDir(id),
      episode_ids: scope,
    });
  }

  /** Each checkpoint gets its own directory under the harness's. */
  checkpointDir(id: string): string {
    return join(this.dir, id);
  }

  /** The environment records a commit of checkpoint `id` wrote. */
  async records(id: string): Promise<Record<string, unknown>[]> {
    const dir = join(this.checkpointDir(id), 'gym', 'environment', 'env');
    const file = (await readdir(dir)).find((f) => f.startsWith('records'));
    const text = await readFile(join(dir, file!), 'utf8');
    return text
      .split('\n')
      .filter((line) => line.length > 0)
      .map((line) => decodeJson(line) as Record<string, unknown>);
  }

  restore(id: string, scope: { rollout_id: string; attempt: number }[]): Promise<Reply> {
    return this.control('restore', {
      checkpoint_id: id,
      deadline_ts: deadline(),
      checkpoint_dir: this.checkpointDir(id),
      episode_ids: scope,
    });
  }

  resume(id: string): Promise<Reply> {
    return this.control('resume', { checkpoint_id: id, deadline_ts: deadline() });
  }

  retire(scope: { rollout_id: string; attempt: number }[], seconds = 30): Promise<Reply> {
    return this.control('retire', {
      checkpoint_id: 'retire',
      deadline_ts: deadline(seconds),
      episode_ids: scope,
    });
  }

  forget(rollouts: string[]): Promise<Reply> {
    return this.control('forget', {
      checkpoint_id: 'forget',
      deadline_ts: deadline(),
      rollout_ids: rollouts,
    });
  }

  /** The participant's readiness report, straight from the participant. */
  report() {
    return this.env.participant!.readiness();
  }
}
