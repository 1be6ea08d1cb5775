import got from 'got';

import type { EnvironmentProtocol } from '../src/protocol.js';
import { Harness, runBody } from './support/harness.js';
import {
  closeConnections,
  send,
  AGENT_RESPONSE,
  Gate,
  MemoryLogger,
  OBSERVATIONS,
  until,
} from '@ckpt-gym/testing';

afterAll(closeConnections);

function start(options: ConstructorParameters<typeof Harness>[0] = {}): Promise<Harness> {
  return new Harness(options).start();
}

const FULL_SEQUENCE = [
  '/seed_session',
  '/v1/agent_sessions',
  '/v1/responses',
  '/v1/agent_sessions/close',
  '/verify',
  '/close_session',
];

/** Every downstream call in arrival order. */
function allPaths(x: Harness): string[] {
  return [...x.resources.calls, ...x.agent.calls].sort((a, b) => a.seq - b.seq).map((c) => c.path);
}

describe.each([true, false])('single_agent_turn (checkpointing %s)', (checkpoint) => {
  it('runs seed, activation, close, verify and replies with the verdict and observations', async () => {
    await using x = await start({ checkpoint });
    const reply = await x.run(runBody('r1'));
    expect(reply.status).toBe(200);
    expect(reply.body).toEqual({
      episode_id: { rollout_id: 'r1', attempt: 0 },
      task_id: { taskset: 'weather', task_id: 't1' },
      result: { reward: 1, response: AGENT_RESPONSE, ng_agent_observations: OBSERVATIONS },
      failure: null,
    });
    expect(allPaths(x)).toEqual(FULL_SEQUENCE);
  });

  it('makes every downstream call under the episode prefix, cleanup included', async () => {
    await using x = await start({ checkpoint });
    await x.run(runBody('r1', 2));
    const keys = [...x.resources.calls, ...x.agent.calls].map((c) => c.key);
    expect(keys).toHaveLength(6);
    expect(new Set(keys)).toEqual(new Set(['r1-a2']));
  });
});

describe('single_agent_turn downstream calls', () => {
  it('sends the activation index, the session cookies and the flat verify body', async () => {
    await using x = await start();
    await x.run(runBody('r1'));
    const activation = x.agent.calls.find((c) => c.path === '/v1/responses')!;
    expect(activation.headers['x-ng-agent-activation']).toBe('1');
    expect(activation.headers.cookie).toMatch(/^agent_session_id=agent-session-[0-9a-f]{32}$/);
    expect(activation.body).toEqual({ input: 'What is the weather in Paris?' });
    const seed = x.resources.calls[0]!;
    expect(seed.body).toEqual({
      resources_session_id: expect.stringMatching(/^resources-session-[0-9a-f]{32}$/),
      episode_id: { rollout_id: 'r1', attempt: 0 },
      task_id: { taskset: 'weather', task_id: 't1' },
      task_data: { expected_city: 'Paris' },
    });
    const verify = x.resources.calls.find((c) => c.path === '/verify')!;
    expect(verify.body).toEqual({
      expected_city: 'Paris',
      responses_create_params: { input: 'What is the weather in Paris?' },
      response: AGENT_RESPONSE,
    });
    expect(verify.headers.cookie).toBe(`session=s-${String(seed.body.resources_session_id)}`);
    const close = x.resources.calls.find((c) => c.path === '/close_session')!;
    expect(close.body).toEqual({
      resources_session_id: seed.body.resources_session_id,
      episode_id: { rollout_id: 'r1', attempt: 0 },
    });
  });

  it('sends x-ng-checkpoint-close-follows only on a replayable verify', async () => {
    await using x = await start();
    x.resources.on('/seed_session', { headers: { 'x-ng-checkpoint-verify': 'replay' } });
    await x.run(runBody('replayable'));
    x.resources.on('/seed_session', {});
    await x.run(runBody('waiting'));
    const verifies = x.resources.calls.filter((c) => c.path === '/verify');
    expect(verifies.map((c) => [c.key, c.headers['x-ng-checkpoint-close-follows']])).toEqual([
      ['replayable', '1'],
      ['waiting', undefined],
    ]);
  });

  it('grants direct HTTP tool access naming the seeding attempt only with checkpointing on', async () => {
    await using on = await start();
    await on.run(runBody('r1', 1));
    const grantOn = on.agent.calls[0]!.body.tool_accesses as Record<string, unknown>[];
    expect(grantOn[0]).toMatchObject({
      kind: 'direct_http',
      name: 'weather.direct_http',
      required: true,
      base_url: `${on.resources.url}/ng-rollout/r1-a1`,
    });
    await using off = await start({ checkpoint: false });
    await off.run(runBody('r1', 1));
    const grantOff = off.agent.calls[0]!.body.tool_accesses as Record<string, unknown>[];
    expect(grantOff[0]!.base_url).toBe(off.resources.url);
  });
});

describe('/aggregate_metrics', () => {
  it('is forwarded unchanged to the resources server', async () => {
    await using x = await start();
    const body = { verify_responses: [{ reward: 1 }, { reward: 0 }] };
    const reply = await x.post('/aggregate_metrics', body);
    expect(reply.body).toEqual({ count: 2 });
    expect(x.resources.calls).toEqual([
      expect.objectContaining({ path: '/aggregate_metrics', key: null, body }),
    ]);
  });

  it.each([
    ['null', 'null'],
    ['a list', '[]'],
    ['a number', '5'],
    ['a bad verify_responses', '{"verify_responses": [1]}'],
  ])('refuses %s with 422 before forwarding anything', async (_what, text) => {
    await using x = await start();
    const reply = await send(`${x.url}/aggregate_metrics`, {
      what: text,
      body: Buffer.from(text),
      contentType: 'application/json',
    });
    expect([reply.status, JSON.parse(reply.text)]).toEqual([
      422,
      { error: { code: 'invalid_request', detail: expect.any(String) } },
    ]);
    expect(x.resources.calls).toEqual([]);
  });

  it('refuses a body without a JSON content type with 422', async () => {
    await using x = await start();
    const text = JSON.stringify({ verify_responses: [] });
    const reply = await send(`${x.url}/aggregate_metrics`, {
      what: 'no content type',
      body: Buffer.from(text),
      contentType: null,
    });
    expect(reply.status).toBe(422);
    expect(x.resources.calls).toEqual([]);
  });

  it("passes on the resources server's refusal, and answers its failure with 502", async () => {
    await using x = await start();
    const body = { verify_responses: [{ reward: 1 }] };
    x.resources.on('/aggregate_metrics', { status: 422, code: 'invalid_request' });
    expect(await x.post('/aggregate_metrics', body)).toEqual({
      status: 422,
      body: { error: { code: 'invalid_request', detail: 'stub failure' } },
    });
    x.resources.on('/aggregate_metrics', { status: 503 });
    expect(await x.post('/aggregate_metrics', body)).toMatchObject({
      status: 502,
      body: { error: { code: 'upstream_error' } },
    });
    x.resources.on('/aggregate_metrics', { destroy: true });
    expect(await x.post('/aggregate_metrics', body)).toMatchObject({
      status: 502,
      body: { error: { code: 'upstream_error' } },
    });
  });
});

describe('single_agent_turn failures', () => {
  it('fails a seed answered 503 as retryable and one answered 400 as terminal, and closes the session', async () => {
    await using x = await start();
    x.resources.on('/seed_session', { status: 503 });
    const retryable = await x.run(runBody('a'));
    expect(retryable.body.failure).toMatchObject({ stage: 'seed', terminal: false });
    x.resources.on('/seed_session', { status: 400 });
    const terminal = await x.run(runBody('b'));
    expect(terminal.body.failure).toMatchObject({ stage: 'seed', terminal: true });
    expect(x.resources.count('/close_session')).toBe(2);
    expect(x.agent.calls).toEqual([]);
  });

  it('fails a seed that sets no session cookie', async () => {
    await using x = await start();
    x.resources.on('/seed_session', { plain: { resources_session_id: 'ignored' } });
    const reply = await x.run(runBody('a'));
    expect(reply.body.failure).toMatchObject({ stage: 'seed', terminal: true });
    expect(String((reply.body.failure as Record<string, unknown>).failure_reason)).toContain(
      'did not establish a session cookie',
    );
  });

  it('closes the agent session at once after a failed activation and keeps its observations', async () => {
    await using x = await start({ checkpoint: false });
    x.agent.on('/v1/responses', { status: 500 });
    const reply = await x.run(runBody('r1'));
    expect(reply.body.failure).toEqual({
      failure_reason: expect.stringContaining('The agent activation failed'),
      terminal: false,
      stage: 'agent',
      ng_agent_observations: OBSERVATIONS,
    });
    expect(allPaths(x)).toEqual([
      '/seed_session',
      '/v1/agent_sessions',
      '/v1/responses',
      '/v1/agent_sessions/close',
      '/close_session',
    ]);
  });

  it('skips verification when the agent close fails, with the response as partial_response', async () => {
    await using x = await start();
    x.agent.on('/v1/agent_sessions/close', { status: 400 });
    const reply = await x.run(runBody('r1'));
    expect(reply.body.failure).toMatchObject({
      stage: 'cleanup',
      terminal: true,
      partial_response: AGENT_RESPONSE,
    });
    expect(x.resources.count('/verify')).toBe(0);
    expect(x.resources.count('/close_session')).toBe(1);
  });

  it('logs an agent close its cleanup timeout stopped with the close’s target and where its time went', async () => {
    const logger = new MemoryLogger();
    await using x = await start({ cleanupTimeoutSeconds: 0.3, logger });
    x.agent.on('/v1/agent_sessions/close', { gate: new Gate() });
    const reply = await x.run(runBody('r1'));
    expect(reply.body.failure).toMatchObject({
      stage: 'cleanup',
      failure_reason: expect.stringContaining('TimeoutError'),
    });
    expect(logger.lines.find((l) => l.message === 'upstream call timed out')).toMatchObject({
      level: 'warn',
      meta: {
        target: `${x.agent.url}/ng-rollout/r1/v1/agent_sessions/close`,
        sent_ms: expect.any(Number),
        reply_ms: null,
      },
    });
  });

  it('fails verification with stage verification and the partial response', async () => {
    await using x = await start();
    x.resources.on('/verify', { status: 502 });
    const reply = await x.run(runBody('r1'));
    expect(reply.body.failure).toMatchObject({
      stage: 'verification',
      terminal: false,
      partial_response: AGENT_RESPONSE,
    });
  });

  it('keeps the verdict when the resources close fails after verify, trying the close twice', async () => {
    await using x = await start();
    x.resources.on('/close_session', { status: 500 });
    const reply = await x.run(runBody('r1'));
    expect(reply.body.result).toMatchObject({ reward: 1 });
    expect(x.resources.count('/close_session')).toBe(2);
  });

  it('fails an episode past its deadline as retryable and still closes its sessions', async () => {
    await using x = await start({ episodeDeadlineSeconds: 0.2 });
    x.agent.on('/v1/responses', { gate: new Gate() });
    const reply = await x.run(runBody('slow'));
    expect(reply.body.failure).toEqual({ failure_reason: 'Episode timed out', terminal: false });
    expect(x.agent.count('/v1/agent_sessions/close')).toBe(1);
    expect(x.resources.count('/close_session')).toBe(1);
    expect(x.report().counts).toEqual({ episodes: 0 });
  });

  it('fails an episode that waits past queue_timeout_seconds for an episode slot', async () => {
    await using x = await start({ queue: { maxConcurrentEpisodes: 1, queueTimeoutSeconds: 0.05 } });
    const gate = new Gate();
    x.agent.on('/v1/responses', { gate });
    const first = x.run(runBody('first'));
    await x.agent.arrived('/v1/responses');
    const second = await x.run(runBody('second'));
    expect(second.body.failure).toEqual({
      failure_reason: 'Episode admission timed out',
      terminal: false,
      stage: 'admission',
    });
    expect(x.resources.calls.filter((c) => c.key === 'second')).toEqual([]);
    gate.open();
    expect((await first).body.result).toMatchObject({ reward: 1 });
  });

  it('with checkpointing on, never re-sends a call after a dropped connection', async () => {
    // A client that would retry a POST on a reset connection; checkpointing must switch it off.
    const retrying = got.extend({
      retry: { limit: 2, methods: ['POST'], errorCodes: ['ECONNRESET'], backoffLimit: 1 },
    });
    for (const checkpoint of [true, false]) {
      await using x = await start({ checkpoint, client: retrying });
      x.agent.on('/v1/responses', { destroy: true });
      const reply = await x.run(runBody('r1'));
      expect(reply.body.failure).toMatchObject({ stage: 'agent', terminal: false });
      expect(x.agent.count('/v1/responses')).toBe(checkpoint ? 1 : 3);
    }
  });
});

describe('boundaries with checkpointing off', () => {
  /** A protocol whose boundaries are builders that count their calls. */
  function countingProtocol(built: { count: number }): EnvironmentProtocol {
    return {
      checkpointBoundaries: true,
      async run(_request, work) {
        await work.boundary(() => {
          built.count += 1;
          return { next: 'only' };
        });
        await work.step('replay', async () => undefined);
        await work.boundary(() => {
          built.count += 1;
          return { next: 'return' };
        });
        return { reward: 1 };
      },
    };
  }

  it('are never built with checkpointing off', async () => {
    const built = { count: 0 };
    await using x = await start({ checkpoint: false, protocol: countingProtocol(built) });
    const reply = await x.run(runBody('r1'));
    expect(reply.body.result).toEqual({ reward: 1 });
    expect(built.count).toBe(0);
  });

  it('are built once, when the episode enters a step a checkpoint exports it in, and a commit reuses them', async () => {
    const built = { count: 0 };
    const gate = new Gate();
    const protocol: EnvironmentProtocol = {
      checkpointBoundaries: true,
      async run(_request, work) {
        await work.boundary(() => {
          built.count += 1;
          return { next: 'waiting' };
        });
        await work.step('replay', () => gate.promise);
        return { reward: 1 };
      },
    };
    await using x = await start({ checkpoint: true, protocol });
    const run = x.run(runBody('r1'));
    // Built (and encoded) in an idle turn once the replay step starts, ahead of any checkpoint.
    await until(() => built.count === 1, 'the boundary to be built ahead');
    expect((await x.prepare('c1')).body.phase).toBe('prepared');
    const commit = await x.commit('c1', null);
    expect(commit.body.episode_ids).toEqual(['r1']);
    expect(built.count).toBe(1);
    await x.resume('c1');
    gate.open();
    expect((await run).body.result).toEqual({ reward: 1 });
  });
});
