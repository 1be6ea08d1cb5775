/**
 * A real stack in one process: this environment server, Simple Agent (agent-server), the weather
 * resources server, a policy model server and the fake inference backend, driven by core's
 * coordination functions.
 *
 * The policy model server sits between Simple Agent (which speaks the Responses API) and the fake
 * backend (chat completions only); @ckpt-gym/policy-model-server resolves to its sources in jest.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { createAgentServer, simpleAgent } from '@ckpt-gym/agent-server';
import {
  commit,
  createHttpClients,
  createParticipants,
  type HttpClients,
  type Participants,
  prepare,
  restore,
  resume,
} from '@ckpt-gym/core/client';
import { type EpisodeId } from '@ckpt-gym/core/protocol';
import { createLogger, listen, type ListeningServer, parseStackFile } from '@ckpt-gym/core/server';
import { type RunningFakeInference, startFakeInference } from '@ckpt-gym/fake-inference';
import { createPolicyModelServer } from '@ckpt-gym/policy-model-server';
import { createResourcesServer, weatherServer } from '@ckpt-gym/resources-server';
import { until } from '@ckpt-gym/testing';
import got from 'got';

import { createEnvironmentServer, type EnvironmentServer } from '../src/app.js';
import { SingleAgentTurn } from '../src/single-agent-turn.js';

const TOKEN = 'integration-token';
const CHECKPOINT = { enabled: true, controlAuthToken: TOKEN, leaseGraceSeconds: 600 } as const;
const R1: EpisodeId = { rollout_id: 'r1', attempt: 0 };
const quiet = (server: string, kind: 'agent' | 'resources' | 'model' | 'environment') =>
  createLogger({ server, kind, level: 'error' });

interface Ports {
  policy: number;
  resources: number;
  agent: number;
  env: number;
}

/** One set of gym processes (in this process) over the shared fake backend. */
class Stack {
  readonly servers: ListeningServer[] = [];
  private readonly closers: (() => void)[] = [];
  env!: EnvironmentServer;
  envUrl = '';
  participants!: Participants;
  ports!: Ports;

  constructor(
    private readonly backend: RunningFakeInference,
    private readonly clients: HttpClients,
  ) {}

  private async serve(app: Parameters<typeof listen>[0], port: number): Promise<ListeningServer> {
    const server = await listen(app, port);
    this.servers.push(server);
    return server;
  }

  /** Starts every gym server; `ports` reuses a dead stack's ports, as a restarted deployment does. */
  async start(ports?: Ports): Promise<this> {
    const stack = parseStackFile(
      [
        `checkpoint: { enabled: true, control_auth_token: ${TOKEN} }`,
        'servers:',
        `  policy: { kind: model, app: policy, port: 0, backend_url: "${this.backend.url}/v1", checkpoint_policy: true }`,
      ].join('\n'),
    );
    const policy = await createPolicyModelServer(stack.servers.get('policy')!, stack, {
      logger: quiet('policy', 'model'),
    });
    const policyServer = await this.serve(policy.app, ports?.policy ?? 0);
    const resources = createResourcesServer(weatherServer(), {
      name: 'weather',
      checkpoint: CHECKPOINT,
      logger: quiet('weather', 'resources'),
    });
    const resourcesServer = await this.serve(resources.app, ports?.resources ?? 0);
    const agent = createAgentServer(simpleAgent, {
      name: 'simple_agent',
      checkpoint: CHECKPOINT,
      config: { model_server_url: policyServer.url, resources_server_url: resourcesServer.url },
      logger: quiet('simple_agent', 'agent'),
    });
    this.closers.push(() => agent.close());
    const agentServer = await this.serve(agent.app, ports?.agent ?? 0);
    this.env = createEnvironmentServer({
      name: 'env',
      checkpoint: CHECKPOINT,
      protocol: new SingleAgentTurn({
        agentUrl: agentServer.url,
        resourcesUrl: resourcesServer.url,
        resourcesName: 'weather',
        client: this.clients.data,
        checkpointing: true,
      }),
      logger: quiet('env', 'environment'),
    });
    const envServer = await this.serve(this.env.app, ports?.env ?? 0);
    this.envUrl = envServer.url;
    this.ports = {
      policy: policyServer.port,
      resources: resourcesServer.port,
      agent: agentServer.port,
      env: envServer.port,
    };
    this.participants = createParticipants(
      [
        { server: 'env', kind: 'environment', url: envServer.url },
        { server: 'policy', kind: 'model', url: policyServer.url },
        { server: 'simple_agent', kind: 'agent', url: agentServer.url },
        { server: 'weather', kind: 'resources', url: resourcesServer.url },
      ],
      { token: TOKEN, clients: this.clients },
    );
    return this;
  }

  /** `/run` for r1 at `attempt`; `replied` turns true once it answered or failed. */
  run(attempt: number): { reply: Promise<Record<string, unknown>>; replied: () => boolean } {
    let done = false;
    const reply = got
      .post(`${this.envUrl}/run`, {
        json: {
          episode_id: { rollout_id: 'r1', attempt },
          task: {
            task_id: { taskset: 'weather', task_id: 'sf' },
            task_input: {
              responses_create_params: { input: 'What is the weather in SF?' },
              task_data: {},
            },
          },
        },
        retry: { limit: 0 },
      })
      .json<Record<string, unknown>>()
      .finally(() => {
        done = true;
      });
    return { reply, replied: () => done };
  }

  /** Every gym process dies at once (the fake backend survives). */
  async crash(): Promise<void> {
    for (const server of this.servers.splice(0).reverse()) {
      server.server.closeAllConnections();
      await server.close();
    }
    for (const close of this.closers.splice(0)) close();
  }
}

describe('a real stack', () => {
  let dir = '';
  let backend: RunningFakeInference;
  let clients: HttpClients;
  const stacks: Stack[] = [];

  beforeEach(async () => {
    dir = await mkdtemp(join(tmpdir(), 'env-integration-'));
    backend = await startFakeInference({ script: 'weather' });
    clients = createHttpClients();
  });

  afterEach(async () => {
    for (const stack of stacks.splice(0)) await stack.crash();
    clients.close();
    await backend.close();
    await rm(dir, { recursive: true, force: true });
  });

  async function startStack(ports?: Ports): Promise<Stack> {
    const stack = await new Stack(backend, clients).start(ports);
    stacks.push(stack);
    return stack;
  }

  /** Holds the episode's second model call, then prepares and commits checkpoint `id`. */
  async function checkpointAtSecondModelCall(stack: Stack, id: string) {
    await got.post(`${backend.url}/_ctl/hold`, { json: { after_calls: 1 } });
    const run = stack.run(0);
    run.reply.catch(() => undefined);
    await until(() => backend.state.queue.waiting === 1, 'the second model call to be held');
    const deadline = Date.now() / 1000 + 30;
    const prepared = await prepare(stack.participants, id, deadline);
    expect(prepared.blockers()).toEqual({});
    expect(prepared.prepared).toBe(true);
    const committed = await commit(
      stack.participants,
      id,
      join(dir, id),
      prepared.continued([R1]),
      deadline,
    );
    expect(committed.env!.episode_ids).toEqual(['r1']);
    return { run, deadline };
  }

  it('runs an episode that a checkpoint parks and a resume releases', async () => {
    const stack = await startStack();
    const { run, deadline } = await checkpointAtSecondModelCall(stack, 'c1');
    // The backend answers, but the policy model holds the reply until resume: the episode stays
    // at its invoke_agent boundary (inside its replay step) and does not reply.
    await got.post(`${backend.url}/_ctl/release`, { json: {} });
    await until(() => backend.state.queue.waiting === 0, 'the backend to answer');
    expect(stack.env.participant!.steps.state('r1')?.state).toBe('replay_step');
    expect(run.replied()).toBe(false);

    await resume(stack.participants, 'c1', deadline);
    const reply = await run.reply;
    expect(reply.failure).toBeNull();
    expect(reply.result).toMatchObject({ reward: 1 });
    expect(stack.env.participant!.steps.size).toBe(0);
  });

  it('continues a checkpointed episode in fresh processes after a crash', async () => {
    const first = await startStack();
    await checkpointAtSecondModelCall(first, 'c1');
    const ports = first.ports;
    stacks.splice(stacks.indexOf(first), 1);
    await first.crash();
    await got.post(`${backend.url}/_ctl/release`, { json: {} });
    await got.post(`${backend.url}/_ctl/hold`, { json: { after_calls: 1000 } });

    const second = await startStack(ports);
    const deadline = Date.now() / 1000 + 30;
    const restored = await restore(second.participants, 'c1', join(dir, 'c1'), [R1], deadline);
    expect(restored.env!.restored).toEqual(['r1-a1']);
    await resume(second.participants, 'c1', deadline);
    const callsBefore = backend.state.calls.count;
    const reply = await second.run(1).reply;
    // Continued, not started over: Simple Agent resumes its turn loop after the tool round, so
    // only the second model call is made again.
    expect(backend.state.calls.count - callsBefore).toBe(1);
    expect(reply.failure).toBeNull();
    expect(reply.result).toMatchObject({ reward: 1 });
    expect(
      (
        await got(`${second.envUrl}/ng-control/v1/checkpoint/status`, {
          headers: { authorization: `Bearer ${TOKEN}` },
        }).json<Record<string, unknown>>()
      ).restored_pending,
    ).toEqual([]);
  });
});
