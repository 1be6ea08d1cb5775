import { MAX_ROLLOUT_ID_LENGTH } from '@ckpt-gym/core/protocol';
import { type EpisodeContext, listen } from '@ckpt-gym/core/server';
import { ep, Gate, until } from '@ckpt-gym/testing';
import express from 'express';

import type { AgentDefinition } from '../src/agent.js';
import { AgentParticipant } from '../src/participant.js';
import { simpleAgent, type SimpleSessionState } from '../src/simple-agent.js';
import {
  commit,
  type Harness,
  post,
  prepare,
  restore,
  resume,
  startAgent,
  startStack,
} from './support/harness.js';

let h: Harness;
const extra: Harness[] = [];
afterEach(async () => {
  for (const x of extra.splice(0)) await x.close();
  await h.close();
});

const RUN_BODY = {
  _ng_rollout_id: 'r1',
  responses_create_params: {
    input: 'What is the weather in SF?',
    tools: [{ type: 'function', name: 'get_weather', parameters: {} }],
  },
};

/** Simple Agent without its session hooks: restart-only under checkpointing. */
const hookless: AgentDefinition<SimpleSessionState> = (context) => {
  const inner = simpleAgent(context);
  return {
    checkpointSessionsSupported: false,
    seedSession: (request) => inner.seedSession(request),
    respond: (invocation) => inner.respond(invocation),
    legacyRun: (request) => inner.legacyRun(request),
    closeSession: (entry) => inner.closeSession(entry),
  };
};

function participant(x: Harness = h): AgentParticipant {
  return x.agent.participant as AgentParticipant;
}

/**
 * Simple Agent whose legacy `/run` holds its loop step's result (the self-dispatch reply on its
 * way back) until `afterLoop` opens.
 */
function loopGatedAgent(afterLoop: Gate): AgentDefinition<SimpleSessionState> {
  return (context) => {
    const agent = simpleAgent(context);
    const run = agent.legacyRun.bind(agent);
    agent.legacyRun = (request) => {
      let next: unknown;
      const ep: EpisodeContext = {
        ...request.ep,
        boundary: (state) => {
          next = typeof state === 'function' ? undefined : state.next;
          return request.ep.boundary(state);
        },
        step: (mode, fn) =>
          request.ep.step(mode, async () => {
            const result = await fn();
            if (next === 'loop') await afterLoop.promise;
            return result;
          }),
      };
      return run({ ...request, ep });
    };
    return agent;
  };
}

async function freshProcess(): Promise<Harness> {
  const next = await startAgent<SimpleSessionState>({
    model: h.model,
    resources: h.resources,
    dir: h.dir,
  });
  extra.push(next);
  return next;
}

describe('legacy /run', () => {
  test('a legacy /run seeds, runs the loop, verifies and returns, all under the rollout prefix', async () => {
    h = await startStack();
    const reply = await post(`${h.url}/run`, RUN_BODY);
    expect(reply.status).toBe(200);
    expect(reply.body.reward).toBe(1);
    expect(reply.body.ng_trajectory).toEqual(expect.objectContaining({ invocation_id: 'root' }));
    expect(h.resources.calls.map((c) => [c.key, c.path])).toEqual([
      ['r1', '/seed_session'],
      ['r1', '/get_weather'],
      ['r1', '/verify'],
    ]);
    // The tool call carries the seed's resources cookie.
    expect(h.resources.calls[1]!.cookie).toBe('res_session=seeded-r1');
    expect(participant().has('run:r1')).toBe(false);
    expect(h.agent.sessions.size).toBe(0);
  });

  test.each([
    ['checkpointing off', { checkpoint: false }],
    ['checkpointing on', {}],
    ['restart-only', { definition: hookless }],
  ])(
    'a row whose indices are neither strings nor numbers is 400 invalid_rollout_id (%s)',
    async (_name, options) => {
      h = await startStack(options);
      const { _ng_rollout_id: _id, ...row } = RUN_BODY;
      for (const index of [{ toString: null }, [{ valueOf: 1 }], true, { a: 1 }]) {
        const reply = await post(`${h.url}/run`, {
          ...row,
          _ng_task_index: 1,
          _ng_rollout_index: index,
        });
        expect([index, reply.status, reply.body.error]).toEqual([
          index,
          400,
          expect.objectContaining({ code: 'invalid_rollout_id' }),
        ]);
      }
      expect(h.resources.calls).toEqual([]);
    },
  );

  test.each([
    ['checkpointing off', { checkpoint: false }],
    ['checkpointing on', {}],
    ['restart-only', { definition: hookless }],
  ])(
    'a row whose rollout id is longer than MAX_ROLLOUT_ID_LENGTH is 400 invalid_rollout_id before any call (%s)',
    async (_name, options) => {
      h = await startStack(options);
      const { _ng_rollout_id: _id, ...row } = RUN_BODY;
      // Past 16 kB the id overflowed the downstream calls' request headers: a 431 about headers
      // the client never sent.
      for (const id of ['r'.repeat(MAX_ROLLOUT_ID_LENGTH + 1), 'r'.repeat(20_000)]) {
        for (const named of [
          { _ng_rollout_id: id },
          { _ng_task_index: id, _ng_rollout_index: 0 },
        ]) {
          const reply = await post(`${h.url}/run`, { ...row, ...named });
          expect([id.length, reply.status, reply.body.error]).toEqual([
            id.length,
            400,
            expect.objectContaining({ code: 'invalid_rollout_id' }),
          ]);
        }
      }
      expect(h.resources.calls).toEqual([]);
    },
  );

  test('a legacy /run whose resources server cannot be reached fails with 502 upstream_error naming it', async () => {
    h = await startStack();
    const gone = await listen(express(), 0);
    await gone.close();
    const agent = await startAgent(h, { config: { resources_server_url: gone.url } });
    extra.push(agent);
    const reply = await post(`${agent.url}/run`, RUN_BODY);
    expect(reply.status).toBe(502);
    expect(reply.body.error).toMatchObject({ code: 'upstream_error' });
    expect((reply.body.error as { detail: string }).detail).toContain(
      `${gone.url}/ng-rollout/r1/seed_session`,
    );
  });

  test('a legacy /run sends activation index 1 on its self-dispatch', async () => {
    h = await startStack();
    const spy: string[] = [];
    const original = participant().activate.bind(participant());
    participant().activate = (key, episode, index, work, signal) => {
      spy.push(`${key}:${String(index)}`);
      return original(key, episode, index, work, signal);
    };
    await post(`${h.url}/run`, RUN_BODY);
    expect(spy).toEqual(['run:r1:1']);
  });

  test('a legacy /run without a rollout id is refused with checkpointing on', async () => {
    h = await startStack();
    const reply = await post(`${h.url}/run`, {
      responses_create_params: RUN_BODY.responses_create_params,
    });
    expect(reply.status).toBe(400);
  });

  test('a new legacy /run is refused with admission_closed while a checkpoint is open', async () => {
    h = await startStack();
    await prepare(h, 'c1');
    const reply = await post(`${h.url}/run`, RUN_BODY);
    expect(reply.status).toBe(409);
    expect((reply.body.error as { code: string }).code).toBe('admission_closed');
    expect(h.resources.calls).toHaveLength(0);
    await resume(h, 'c1');
  });

  test('a legacy /run closes its resources session after a verification a checkpoint does not wait for', async () => {
    h = await startStack({ verifyMode: 'replay' });
    await post(`${h.url}/run`, RUN_BODY);
    const paths = h.resources.calls.map((c) => c.path);
    expect(paths).toEqual(['/seed_session', '/get_weather', '/verify', '/close_session']);
    expect(h.resources.calls[2]!.headers['x-ng-checkpoint-close-follows']).toBe('1');
  });

  test('a legacy /run with a waited-for verification sends no close-follows and does not close', async () => {
    h = await startStack({ verifyMode: 'wait' });
    await post(`${h.url}/run`, RUN_BODY);
    expect(h.resources.calls.map((c) => c.path)).toEqual([
      '/seed_session',
      '/get_weather',
      '/verify',
    ]);
    expect(h.resources.calls[2]!.headers['x-ng-checkpoint-close-follows']).toBeUndefined();
  });

  test('a legacy /run that skips verification parks at its return boundary until resume', async () => {
    const afterLoop = new Gate();
    h = await startStack({
      definition: loopGatedAgent(afterLoop),
      config: { skip_verification: true, skip_verification_reward: 0.5 },
    });
    let done = false;
    const running = post(`${h.url}/run`, RUN_BODY).then((r) => {
      done = true;
      return r;
    });
    await until(
      () => h.model.calls.length === 2 && participant().runningActivation('run:r1') === null,
      'the loop',
    );
    expect((await prepare(h, 'c1')).phase).toBe('prepared');
    afterLoop.open();
    await until(
      () => participant().steps.state('run:r1')?.state === 'parked',
      'the park at return',
    );
    const records = await participant().export(null, new AbortController().signal);
    expect(records[0]!.episode).toEqual(expect.objectContaining({ next: 'return' }));
    // The return boundary holds the loop's reply; the kept activation reply is gone.
    expect((records[0]!.session as { completed_reply: unknown }).completed_reply).toBeNull();
    expect(done).toBe(false);
    await resume(h, 'c1');
    const reply = await running;
    expect(reply.body).toEqual(
      expect.objectContaining({ reward: 0.5, verification_skipped: true }),
    );
  });

  test('a checkpoint of a legacy /run parked at verify holds its reply once, and a restore still replies', async () => {
    const afterLoop = new Gate();
    h = await startStack({ definition: loopGatedAgent(afterLoop) });
    const abort = new AbortController();
    const running = post(`${h.url}/run`, RUN_BODY, {}, abort.signal).catch(() => undefined);
    await until(
      () => h.model.calls.length === 2 && participant().runningActivation('run:r1') === null,
      'the loop',
    );
    await prepare(h, 'c1');
    afterLoop.open();
    await until(
      () => participant().steps.state('run:r1')?.state === 'parked',
      'the park at verify',
    );
    const records = await participant().export(null, new AbortController().signal);
    expect(records[0]!.episode).toEqual(expect.objectContaining({ next: 'verify' }));
    expect((records[0]!.session as { completed_reply: unknown }).completed_reply).toBeNull();
    expect(await commit(h, 'c1', [ep('r1')])).toEqual(['r1']);
    abort.abort();
    await running;
    const next = await freshProcess();
    expect((await restore(next, 'c1', [ep('r1')])).status).toBe(200);
    await resume(next, 'c1');
    const calls = h.model.calls.length;
    const reply = await post(`${next.url}/ng-rollout/r1-a1/run`, RUN_BODY);
    expect(reply.status).toBe(200);
    expect(reply.body.reward).toBe(1);
    expect(reply.body.ng_trajectory).toEqual(expect.objectContaining({ invocation_id: 'root' }));
    expect(h.model.calls).toHaveLength(calls);
    expect(h.resources.calls.map((c) => [c.key, c.path]).slice(-1)).toEqual([['r1-a1', '/verify']]);
  });

  test('a restore after the legacy turn loop replied returns that reply without running the loop again', async () => {
    const afterLoop = new Gate();
    h = await startStack({ definition: loopGatedAgent(afterLoop) });
    const abort = new AbortController();
    const running = post(`${h.url}/run`, RUN_BODY, {}, abort.signal).catch(() => undefined);
    await until(
      () => h.model.calls.length === 2 && participant().runningActivation('run:r1') === null,
      'the loop',
    );
    // The loop replied; /run has not recorded its verify boundary yet.
    expect((await prepare(h, 'c1')).phase).toBe('prepared');
    const records = await participant().export(null, new AbortController().signal);
    expect(records[0]!.episode).toEqual(expect.objectContaining({ next: 'loop' }));
    expect(await commit(h, 'c1', [ep('r1')])).toEqual(['r1']);
    abort.abort();
    afterLoop.open();
    await running;
    const next = await freshProcess();
    expect((await restore(next, 'c1', [ep('r1')])).status).toBe(200);
    await resume(next, 'c1');
    const calls = h.model.calls.length;
    const reply = await post(`${next.url}/ng-rollout/r1-a1/run`, RUN_BODY);
    expect(reply.status).toBe(200);
    expect(reply.body.reward).toBe(1);
    expect(h.model.calls).toHaveLength(calls);
  });

  test('a legacy /run works with checkpointing off', async () => {
    h = await startStack({ checkpoint: false });
    const reply = await post(`${h.url}/run`, {
      responses_create_params: RUN_BODY.responses_create_params,
    });
    expect(reply.body.reward).toBe(1);
    expect(h.resources.calls.map((c) => c.key)).toEqual([null, null, null]);
  });

  test('a restored legacy /run claimed at verify is no longer pending and survives a commit that leaves it out', async () => {
    const afterLoop = new Gate();
    h = await startStack({ definition: loopGatedAgent(afterLoop), verifyMode: 'replay' });
    const abort = new AbortController();
    const running = post(`${h.url}/run`, RUN_BODY, {}, abort.signal).catch(() => undefined);
    await until(
      () => h.model.calls.length === 2 && participant().runningActivation('run:r1') === null,
      'the loop',
    );
    await prepare(h, 'c1');
    afterLoop.open();
    await until(
      () => participant().steps.state('run:r1')?.state === 'parked',
      'the park at verify',
    );
    await commit(h, 'c1', [ep('r1')]);
    abort.abort();
    await running;
    const next = await freshProcess();
    await restore(next, 'c1', [ep('r1')]);
    await resume(next, 'c1');
    expect(participant(next).restoredPending()).toEqual([ep('r1', 1)]);
    const verify = h.resources.holdNext();
    const replacement = post(`${next.url}/ng-rollout/r1-a1/run`, RUN_BODY);
    await verify.arrived;
    expect(participant(next).restoredPending()).toEqual([]);
    // A replayable verify does not hold up prepare; the scope leaves the live run out.
    expect((await prepare(next, 'c2')).phase).toBe('prepared');
    expect(await commit(next, 'c2', [])).toEqual([]);
    await resume(next, 'c2');
    verify.gate.open();
    const reply = await replacement;
    expect(reply.body.reward).toBe(1);
    expect(h.resources.calls.map((c) => [c.key, c.path]).slice(-2)).toEqual([
      ['r1-a1', '/verify'],
      ['r1-a1', '/close_session'],
    ]);
  });

  test('a legacy /run checkpointed inside its turn loop continues the loop from its boundary', async () => {
    h = await startStack();
    const first = h.model.holdNext();
    const abort = new AbortController();
    const running = post(`${h.url}/run`, RUN_BODY, {}, abort.signal).catch(() => undefined);
    await first.arrived;
    const second = h.model.holdNext();
    first.gate.open();
    await second.arrived;
    // Parked after its tool round, waiting on the second model call.
    expect((await prepare(h, 'c1')).phase).toBe('prepared');
    expect(await commit(h, 'c1', [ep('r1')])).toEqual(['r1']);
    abort.abort();
    second.gate.open();
    await running;
    const next = await freshProcess();
    await restore(next, 'c1', [ep('r1')]);
    await resume(next, 'c1');
    const calls = {
      model: h.model.calls.length,
      tools: h.resources.calls.filter((c) => c.path === '/get_weather').length,
    };
    const reply = await post(`${next.url}/ng-rollout/r1-a1/run`, RUN_BODY);
    expect(reply.body.reward).toBe(1);
    // Only the model call after the tool round is made again; the tool is not called twice.
    expect(h.model.calls.slice(calls.model).map((c) => c.key)).toEqual(['r1-a1']);
    expect(h.resources.calls.filter((c) => c.path === '/get_weather')).toHaveLength(calls.tools);
  });
});
