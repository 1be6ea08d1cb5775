import { ep, Gate, until } from '@ckpt-gym/testing';
import { jest } from '@jest/globals';

import type { AgentDefinition } from '../src/agent.js';
import { AgentParticipant } from '../src/participant.js';
import { simpleAgent, type SimpleSessionState } from '../src/simple-agent.js';
import {
  activate,
  closeSession,
  commit,
  control,
  errorCode,
  type Harness,
  post,
  prepare,
  restore,
  resume,
  retire,
  seed,
  startStack,
} from './support/harness.js';

function participant(h: Harness): AgentParticipant {
  return h.agent.participant as AgentParticipant;
}

function counts(h: Harness): Record<string, number> {
  return participant(h).readiness().counts;
}

/** Simple Agent with gates a test can put in front of its hooks, and counts of each hook call. */
function gatedSimpleAgent(gates: {
  seed?: Gate;
  close?: Gate;
  retire?: Gate;
  /** Held inside respond, ignoring cancellation, until opened. */
  respond?: Gate;
}): { definition: AgentDefinition<SimpleSessionState>; calls: { close: number; retire: number } } {
  const calls = { close: 0, retire: 0 };
  const definition: AgentDefinition<SimpleSessionState> = (context) => {
    const agent = simpleAgent(context);
    const { seedSession, respond, closeSession: close } = agent;
    const retireHook = agent.hooks.retireAgentSession;
    agent.seedSession = async (request) => {
      await gates.seed?.promise;
      return seedSession.call(agent, request);
    };
    agent.respond = async (inv) => {
      await gates.respond?.promise;
      return respond.call(agent, inv);
    };
    agent.closeSession = async (entry) => {
      calls.close += 1;
      await gates.close?.promise;
      return close.call(agent, entry);
    };
    agent.hooks.retireAgentSession = async (key) => {
      calls.retire += 1;
      await gates.retire?.promise;
      return retireHook(key);
    };
    return agent;
  };
  return { definition, calls };
}

describe('closes', () => {
  test('a close that arrives after prepare waits for resume and the commit exports its session', async () => {
    await using h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    expect((await prepare(h, 'c1')).phase).toBe('prepared');
    let closed = false;
    const closing = closeSession(h, s).then((r) => {
      closed = true;
      return r;
    });
    await until(() => counts(h).waiting_for_resume === 1, 'the close to wait');
    // Waiting for resume holds up nothing.
    expect(participant(h).ready()).toBe(true);
    expect(await commit(h, 'c1', null)).toEqual(['r1']);
    expect(closed).toBe(false);
    await resume(h, 'c1');
    expect((await closing).status).toBe(200);
  });

  test('a close stops the activation before its cleanup starts', async () => {
    const gates = { close: new Gate() };
    const { definition } = gatedSimpleAgent(gates);
    await using h = await startStack({ definition });
    const s = await seed(h, 'sess-1', 'r1');
    const held = h.model.holdNext();
    const running = activate(h, s, 'r1', 1);
    await held.arrived;
    const closing = closeSession(h, s);
    const stopped = await running;
    expect(stopped.status).toBe(409);
    // The activation has ended while the cleanup is still held.
    expect(participant(h).runningActivation('sess-1')).toBeNull();
    gates.close.open();
    expect((await closing).status).toBe(200);
    held.gate.open();
    expect(h.resources.calls).toHaveLength(0);
  });

  test('a close cancelled while it stops the activation runs the cleanup once when retried', async () => {
    const gates = { respond: new Gate() };
    const { definition, calls } = gatedSimpleAgent(gates);
    await using h = await startStack({ definition });
    const s = await seed(h, 'sess-1', 'r1');
    const running = activate(h, s, 'r1', 1);
    await until(() => participant(h).runningActivation('sess-1') !== null, 'the activation');
    const abort = new AbortController();
    const first = closeSession(h, s, undefined, abort.signal).catch(() => 'aborted');
    await until(() => participant(h).readiness().blockers.includes('r1'), 'the close to block');
    abort.abort();
    expect(await first).toBe('aborted');
    // The activation has not stopped: the session stays tracked and blocking, no cleanup ran.
    await until(() => h.agent.sessions.get('sess-1')?.closing === false, 'close to give up');
    expect(participant(h).readiness().blockers).toEqual(['r1']);
    expect(calls.close).toBe(0);
    const second = closeSession(h, s);
    gates.respond.open();
    expect((await second).status).toBe(200);
    await running;
    expect(calls.close).toBe(1);
  });

  test('a retire that frees a session while its close runs leaves no receipt behind', async () => {
    const gates = { close: new Gate() };
    const { definition, calls } = gatedSimpleAgent(gates);
    await using h = await startStack({ definition });
    const s = await seed(h, 'sess-1', 'r1');
    const closing = closeSession(h, s);
    await until(() => calls.close === 1, 'the close hook');
    const retired = retire(h, [ep('r1')]);
    await until(() => calls.retire === 1, 'the retire hook');
    gates.close.open();
    const reply = await closing;
    expect(reply.status).toBe(409);
    expect(errorCode(reply)).toBe('stale_attempt');
    expect((await retired).status).toBe(200);
    expect(h.agent.sessions.hasReceipt('sess-1')).toBe(false);
    expect(h.agent.sessions.get('sess-1')).toBeUndefined();
  });
});

describe('retire', () => {
  test('a retire stops the activation before it replies, and a late activation is stale_attempt', async () => {
    await using h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    const held = h.model.holdNext();
    const running = activate(h, s, 'r1', 1);
    await held.arrived;
    const retired = await retire(h, [ep('r1')]);
    expect(retired.body).toEqual({ retired_count: 1 });
    expect(participant(h).runningActivation('sess-1')).toBeNull();
    expect(h.agent.sessions.get('sess-1')).toBeUndefined();
    expect(errorCode(await running)).toBe('stale_attempt');
    held.gate.open();
    expect(errorCode(await activate(h, s, 'r1', 2))).toBe('stale_attempt');
    expect(errorCode((await seed(h, 'sess-2', 'r1')).reply)).toBe('stale_attempt');
  });

  test('a retire touches only its own rollout', async () => {
    await using h = await startStack();
    const s1 = await seed(h, 'sess-1', 'r1');
    const s2 = await seed(h, 'sess-2', 'r2');
    const held = h.model.holdNext();
    const other = activate(h, s2, 'r2', 1);
    await held.arrived;
    expect((await retire(h, [ep('r1')])).status).toBe(200);
    expect(h.agent.sessions.get('sess-1')).toBeUndefined();
    expect(participant(h).runningActivation('sess-2')).not.toBeNull();
    held.gate.open();
    expect((await other).status).toBe(200);
    expect(errorCode(await activate(h, s1, 'r1', 1))).toBe('stale_attempt');
  });

  test('a session whose retire hook was cut short stays blocking, is not exported, and is freed by a retry', async () => {
    const gates = { retire: new Gate() };
    const { definition, calls } = gatedSimpleAgent(gates);
    await using h = await startStack({ definition });
    await seed(h, 'sess-1', 'r1');
    const cut = await retire(h, [ep('r1')], 1);
    expect(errorCode(cut)).toBe('deadline_exceeded');
    expect(participant(h).readiness().blockers).toEqual(['r1']);
    expect(await participant(h).export(null, new AbortController().signal)).toEqual([]);
    // A retry cut short again waits for the same hook call instead of starting another.
    expect(errorCode(await retire(h, [ep('r1')], 1))).toBe('deadline_exceeded');
    expect(calls.retire).toBe(1);
    const forget = await control(h, 'forget', { checkpoint_id: 'f1', rollout_ids: ['r1'] });
    expect(errorCode(forget)).toBe('retire_incomplete');
    gates.retire.open();
    expect((await retire(h, [ep('r1')])).status).toBe(200);
    expect(calls.retire).toBe(1);
    expect(participant(h).readiness().blockers).toEqual([]);
    expect(h.agent.sessions.size).toBe(0);
  });
});

describe('seeds', () => {
  test('a seed arriving during an open checkpoint waits for resume', async () => {
    await using h = await startStack();
    await prepare(h, 'c1');
    let done = false;
    const seeding = seed(h, 'sess-1', 'r1').then((r) => {
      done = true;
      return r;
    });
    await until(() => counts(h).waiting_for_resume === 1, 'the seed to wait');
    expect(participant(h).ready()).toBe(true);
    expect(done).toBe(false);
    await resume(h, 'c1');
    expect((await seeding).reply.status).toBe(200);
  });

  test('a seed in progress when admission closes holds up prepare and is exported', async () => {
    const gates = { seed: new Gate() };
    const { definition } = gatedSimpleAgent(gates);
    await using h = await startStack({ definition });
    const seeding = seed(h, 'sess-1', 'r1');
    await until(() => counts(h).seeds === 1, 'the seed');
    expect(participant(h).ready()).toBe(false);
    const first = await prepare(h, 'c1', { seconds: 0.3 });
    expect(first.phase).toBe('preparing');
    expect(first.report.blockers).toEqual(['r1']);
    gates.seed.open();
    await seeding;
    expect((await prepare(h, 'c1')).phase).toBe('prepared');
    expect(await commit(h, 'c1', null)).toEqual(['r1']);
    await resume(h, 'c1');
  });

  test('overlapping seeds of one session each hold up prepare until both finish', async () => {
    const gates = { seed: new Gate() };
    const { definition } = gatedSimpleAgent(gates);
    await using h = await startStack({ definition });
    const a = seed(h, 'sess-1', 'r1');
    const b = seed(h, 'sess-1', 'r1');
    await until(() => counts(h).seeds === 2, 'both seeds');
    gates.seed.open();
    expect((await a).reply.status).toBe(200);
    expect((await b).reply.status).toBe(200);
    expect(counts(h).seeds).toBe(0);
    expect(h.agent.sessions.size).toBe(1);
  });

  test('a retire waits for a seed in progress and frees what it built', async () => {
    const gates = { seed: new Gate() };
    const { definition } = gatedSimpleAgent(gates);
    await using h = await startStack({ definition });
    const seeding = seed(h, 'sess-1', 'r1');
    await until(() => counts(h).seeds === 1, 'the seed');
    // While the seed is held, the retire cannot finish.
    expect(errorCode(await retire(h, [ep('r1')], 1))).toBe('deadline_exceeded');
    gates.seed.open();
    expect((await retire(h, [ep('r1')])).status).toBe(200);
    expect(errorCode((await seeding).reply)).toBe('stale_attempt');
    expect(h.agent.sessions.size).toBe(0);
    expect(participant(h).has('sess-1')).toBe(false);
  });

  test('a restore is refused while a seed is in progress', async () => {
    const gates = { seed: new Gate() };
    const { definition } = gatedSimpleAgent(gates);
    await using h = await startStack({ definition });
    const seeding = seed(h, 'sess-1', 'r1');
    await until(() => counts(h).seeds === 1, 'the seed');
    const reply = await restore(h, 'c0', [ep('r9')]);
    expect(errorCode(reply)).toBe('checkpoint_error');
    gates.seed.open();
    await seeding;
  });
});

describe('restarts', () => {
  test('a carried restart is neither waited for nor exported, and its activation parks until resume', async () => {
    await using h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    const tool = h.resources.holdNext();
    let done = false;
    const running = activate(h, s, 'r1', 1).then((r) => {
      done = true;
      return r;
    });
    await tool.arrived;
    // r1 is inside a tool call, between boundaries; an earlier stage reported it as a restart.
    const prepared = await prepare(h, 'c1', { restarts: ['r1'] });
    expect(prepared.phase).toBe('prepared');
    expect(await commit(h, 'c1', null)).toEqual([]);
    tool.gate.open();
    await until(() => participant(h).readiness().counts.at_boundary === 1, 'the park');
    expect(done).toBe(false);
    await resume(h, 'c1');
    expect((await running).status).toBe(200);
  });

  test('without the carried restart, the same activation holds up prepare', async () => {
    await using h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    const tool = h.resources.holdNext();
    const running = activate(h, s, 'r1', 1);
    await tool.arrived;
    const prepared = await prepare(h, 'c1', { seconds: 0.3 });
    expect(prepared.report.blockers).toEqual(['r1']);
    tool.gate.open();
    await until(() => participant(h).ready(), 'ready');
    await prepare(h, 'c1');
    await resume(h, 'c1');
    expect((await running).status).toBe(200);
  });

  test('a direct /v1/responses call is a restart, and one without a rollout path is refused', async () => {
    await using h = await startStack();
    const tool = h.resources.holdNext();
    const body = { input: 'weather?' };
    const running = post(`${h.url}/ng-rollout/d1/v1/responses`, body);
    await tool.arrived;
    const report = participant(h).readiness();
    expect(report.restarts).toEqual(['d1']);
    expect(report.ready).toBe(true);
    tool.gate.open();
    expect((await running).status).toBe(200);
    const refused = await post(`${h.url}/v1/responses`, body);
    expect(refused.status).toBe(400);
    expect(errorCode(refused)).toBe('rollout_id_required');
  });
});

describe('readiness', () => {
  test('ready() does not build the readiness report, and nothing notifies outside a checkpoint', async () => {
    await using h = await startStack();
    let notified = 0;
    participant(h).onChange(() => {
      notified += 1;
    });
    const readiness = jest.spyOn(participant(h), 'readiness');
    const s = await seed(h, 'sess-1', 'r1');
    await activate(h, s, 'r1', 1);
    await closeSession(h, s);
    expect(participant(h).ready()).toBe(true);
    expect(readiness).not.toHaveBeenCalled();
    expect(notified).toBe(0);
  });
});
