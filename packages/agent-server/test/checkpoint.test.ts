import { jest } from '@jest/globals';
import { decodeJson, encodeJson, type JsonObject, type JsonValue } from '@ckpt-gym/core/protocol';
import { participantDir, RECORD_FIELDS_JSON } from '@ckpt-gym/core/server';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';

import { ep, until, writeCorruptedCopy } from '@ckpt-gym/testing';

import type { AgentSessionRecord } from '../src/participant.js';
import { exportSession } from '../src/simple-agent.js';
import {
  activate,
  closeSession,
  commit,
  errorCode,
  type Harness,
  post,
  prepare,
  restore,
  resume,
  seed,
  type Seeded,
  startAgent,
  startStack,
  weatherAccess,
} from './support/harness.js';

let h: Harness;
const extra: Harness[] = [];
afterEach(async () => {
  for (const x of extra.splice(0)) await x.close();
  await h.close();
});

/** A fresh agent process on the same stubs and checkpoint directory (after a "crash"). */
async function freshProcess(): Promise<Harness> {
  const next = await startAgent({ model: h.model, resources: h.resources, dir: h.dir });
  extra.push(next);
  return next;
}

/** Writes checkpoint c2: c1 with r1's session state replaced by `text` (the store writes it). */
function copyWithSessionOfR1(text: string): Promise<void> {
  return writeCorruptedCopy({
    from: join(h.dir, 'c1'),
    to: join(h.dir, 'c2'),
    kind: 'agent',
    instance: 'simple_agent',
    checkpointId: 'c2',
    rollout: 'r1',
    field: 'session',
    text,
  });
}

/**
 * Seeds `sess-1` on r1, holds activation 1 inside its first model call, checkpoints it (scope r1),
 * then drops the old process's request and restores the checkpoint into a fresh process.
 */
async function checkpointInFirstModelCall(): Promise<{ next: Harness; cookie: string }> {
  const s = await seed(h, 'sess-1', 'r1');
  const held = h.model.holdNext();
  const abort = new AbortController();
  const running = activate(h, s, 'r1', 1, abort.signal).catch(() => undefined);
  await held.arrived;
  expect((await prepare(h, 'c1')).phase).toBe('prepared');
  expect(await commit(h, 'c1', [ep('r1')])).toEqual(['r1']);
  abort.abort();
  held.gate.open();
  await running;
  const next = await freshProcess();
  const restored = await restore(next, 'c1', [ep('r1')]);
  expect(restored.status).toBe(200);
  await resume(next, 'c1');
  return { next, cookie: s.cookie };
}

/**
 * Seeds `sess-1` on r1, completes activation 1, checkpoints it (scope r1) and restores the
 * checkpoint into a fresh process, resumed.
 */
async function restoredAfterActivation(): Promise<{ s: Seeded; next: Harness }> {
  const s = await seed(h, 'sess-1', 'r1');
  await activate(h, s, 'r1', 1);
  await prepare(h, 'c1');
  await commit(h, 'c1', [ep('r1')]);
  const next = await freshProcess();
  await restore(next, 'c1', [ep('r1')]);
  await resume(next, 'c1');
  return { s, next };
}

describe('agent participant: activations under checkpointing', () => {
  test('an activation without the rollout prefix is refused for a session seeded in this process, with no model call', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    const reply = await activate(h, s, null, 1);
    expect(reply.status).toBe(400);
    expect(errorCode(reply)).toBe('rollout_id_required');
    expect(h.model.calls).toHaveLength(0);
  });

  test('an activation without the rollout prefix is refused for a restored session, with no replay or claim', async () => {
    h = await startStack();
    const { next, cookie } = await checkpointInFirstModelCall();
    const calls = h.model.calls.length;
    const reply = await activate(next, { id: 'sess-1', cookie }, null, 1);
    expect(errorCode(reply)).toBe('rollout_id_required');
    expect(h.model.calls).toHaveLength(calls);
    expect(next.agent.participant!.restoredPending()).toEqual([ep('r1', 1)]);
  });

  test('a seed retried for a restored session is compared with its restored seed body', async () => {
    h = await startStack();
    const { next, cookie } = await checkpointInFirstModelCall();
    // The restored body: the original seed under the replacement attempt.
    const tools = [weatherAccess(h.resources.url, 'r1')];
    const same = await seed(next, 'sess-1', 'r1', { attempt: 1, tools });
    expect(same.reply.status).toBe(200);
    expect(same.cookie).toBe(cookie);
    const other = await seed(next, 'sess-1', 'r1', { attempt: 1, tools: [] });
    expect(other.reply.status).toBe(409);
    expect(next.agent.participant!.restoredPending()).toEqual([ep('r1', 1)]);
  });

  test('a request on the replaced attempt path is refused for the restored session', async () => {
    h = await startStack();
    const { next, cookie } = await checkpointInFirstModelCall();
    const reply = await activate(next, { id: 'sess-1', cookie }, 'r1', 1);
    expect(reply.status).toBe(409);
    expect(errorCode(reply)).toBe('stale_attempt');
    // Nor may an attempt other than the session's own, even one nothing retired.
    expect(errorCode(await activate(next, { id: 'sess-1', cookie }, 'r1-a2', 1))).toBe(
      'stale_attempt',
    );
    expect(next.agent.participant!.restoredPending()).toEqual([ep('r1', 1)]);
  });

  test('a restored activation continues from its boundary under the replacement prefix and keeps its invocation id', async () => {
    h = await startStack();
    const { next, cookie } = await checkpointInFirstModelCall();
    const before = h.model.calls.length;
    const reply = await activate(next, { id: 'sess-1', cookie }, 'r1-a1', 1);
    expect(reply.status).toBe(200);
    // The restored boundary is before the first model call: the call is made again, then the tool.
    expect(h.model.calls.slice(before).map((c) => c.key)).toEqual(['r1-a1', 'r1-a1']);
    expect(h.resources.calls.map((c) => c.key)).toEqual(['r1-a1']);
    const closed = await closeSession(next, { id: 'sess-1', cookie });
    const ids = (closed.body.agent_observations as { invocations: { invocation_id: string }[] })
      .invocations;
    expect(ids.map((i) => i.invocation_id)).toEqual(['root']);
  });

  test('a restored session’s next activation does not reuse an invocation id', async () => {
    h = await startStack();
    const { s, next } = await restoredAfterActivation();
    expect((await activate(next, s, 'r1-a1', 2)).status).toBe(200);
    const closed = await closeSession(next, s);
    const ids = (closed.body.agent_observations as { invocations: { invocation_id: string }[] })
      .invocations;
    expect(ids.map((i) => i.invocation_id)).toEqual(['root', 'activation-2']);
  });

  test('an activation already completed is answered with its stored reply without running again', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    const first = await activate(h, s, 'r1', 1);
    await prepare(h, 'c1');
    await commit(h, 'c1', [ep('r1')]);
    const next = await freshProcess();
    await restore(next, 'c1', [ep('r1')]);
    await resume(next, 'c1');
    const calls = h.model.calls.length;
    const again = await activate(next, s, 'r1-a1', 1);
    expect(again.status).toBe(200);
    expect(again.body).toEqual(first.body);
    expect(h.model.calls).toHaveLength(calls);
    // No change to observations or the activation count either.
    const entry = next.agent.sessions.get('sess-1')!;
    expect([entry.activations, entry.completedActivation]).toEqual([1, 1]);
  });

  test('an activation index out of order is refused with 409 activation_out_of_order', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    expect(errorCode(await activate(h, s, 'r1', 2))).toBe('activation_out_of_order');
    const bad = await activate(h, s, 'r1', 1);
    expect(bad.status).toBe(200);
    expect(errorCode(await activate(h, s, 'r1', 3))).toBe('activation_out_of_order');
    expect(h.model.calls).toHaveLength(2);
  });

  test('an indexed session reply and its replay carry no trajectory, nor does the export', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    const reply = await activate(h, s, 'r1', 1);
    expect(reply.body).not.toHaveProperty('_ng_trajectory');
    const replay = await activate(h, s, 'r1', 1);
    expect(replay.body).not.toHaveProperty('_ng_trajectory');
    const exported = await h.agent.participant!.export(null, new AbortController().signal);
    expect(JSON.stringify(exported)).not.toContain('_ng_trajectory');
    // A caller that sends no index still gets it.
    const s2 = await seed(h, 'sess-2', 'r2');
    expect((await activate(h, s2, 'r2')).body).toHaveProperty('_ng_trajectory');
  });

  test('an activation without an index keeps no reply', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    await activate(h, s, 'r1');
    const entry = h.agent.sessions.get('sess-1')!;
    expect(entry.completedActivation).toBe(1);
    expect(entry.completedReply).toBeNull();
  });

  test('a request for an activation still running waits for it and gets its reply', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    const held = h.model.holdNext();
    const first = activate(h, s, 'r1', 1);
    await held.arrived;
    const second = activate(h, s, 'r1', 1);
    await until(() => h.agent.participant !== undefined, 'participant');
    held.gate.open();
    const [a, b] = await Promise.all([first, second]);
    expect(b.status).toBe(200);
    expect(b.body).toEqual(a.body);
    expect(h.model.calls).toHaveLength(2);
  });

  test('a model reply that arrives after prepare is held at the boundary before the call', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    const held = h.model.holdNext();
    let done = false;
    const running = activate(h, s, 'r1', 1).then((r) => {
      done = true;
      return r;
    });
    await held.arrived;
    expect((await prepare(h, 'c1')).phase).toBe('prepared');
    held.gate.open();
    await held.sent;
    // The reply arrived; give the loop the chance to (wrongly) run its tool call before resume.
    await new Promise((r) => setTimeout(r, 200));
    expect(h.agent.participant!.ready()).toBe(true);
    const records = await h.agent.participant!.export(null, new AbortController().signal);
    expect(records[0]!.boundary).toEqual(
      expect.objectContaining({ step: 0, pending_tools: false, new_outputs: [] }),
    );
    expect(h.resources.calls).toHaveLength(0);
    expect(done).toBe(false);
    await resume(h, 'c1');
    expect((await running).status).toBe(200);
    expect(h.resources.calls).toHaveLength(1);
  });

  test('a session at a model call with admission open is not encoded ahead before it settles; a prepare encodes it at once', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    const exportHook = jest.spyOn(h.agent.agent.hooks!, 'exportAgentSessions');
    const held = h.model.holdNext();
    const running = activate(h, s, 'r1', 1);
    await held.arrived;
    await new Promise((r) => setImmediate(r));
    await new Promise((r) => setImmediate(r));
    // Admission is open and the call has not settled: no work ahead for a call that may end now.
    expect(exportHook).not.toHaveBeenCalled();
    expect((await prepare(h, 'c1')).phase).toBe('prepared');
    // Closing admission hurried it into the next idle turn (its settle time is 1 s).
    await new Promise((r) => setImmediate(r));
    expect(exportHook).toHaveBeenCalledTimes(1);
    expect(exportHook).toHaveBeenCalledWith(['sess-1']);
    await resume(h, 'c1');
    held.gate.open();
    expect((await running).status).toBe(200);
  });

  test('a session held at a model call is exported with its fields already JSON, and its boundary and state JSON are reused', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    const held = h.model.holdNext();
    const running = activate(h, s, 'r1', 1);
    await held.arrived;
    await new Promise((r) => setImmediate(r)); // the idle turn that encodes
    const [record] = await h.agent.participant!.export(null, new AbortController().signal);
    const { episode_id: _, ...fields } = record!;
    const pieces = record![RECORD_FIELDS_JSON]?.join('');
    expect(pieces).toBe(encodeJson(fields).slice(1, -1));
    // Built once (and encoded in an idle turn): a second export reuses it.
    const [again] = await h.agent.participant!.export(null, new AbortController().signal);
    expect(again!.boundary).toBe(record!.boundary);
    // An unchanged session is exported as the same object, whose JSON is reused: changing it in
    // place (which an agent must not do) shows the text is the one encoded before.
    expect(again!.session).toBe(record!.session);
    (record!.session as Record<string, unknown>).activations = 99;
    const [third] = await h.agent.participant!.export(null, new AbortController().signal);
    expect(third![RECORD_FIELDS_JSON]?.join('')).toBe(pieces);
    held.gate.open();
    expect((await running).status).toBe(200);
  });

  test('a record encoded ahead is encoded again once the session gets a new state or a new boundary', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    const first = h.model.holdNext();
    const running = activate(h, s, 'r1', 1);
    await first.arrived;
    await new Promise((r) => setImmediate(r)); // the idle turn that encodes
    const text = (record: AgentSessionRecord) => record[RECORD_FIELDS_JSON]?.join('');
    const fieldsJson = (record: AgentSessionRecord) => {
      const { episode_id: _, ...fields } = record;
      return encodeJson(fields).slice(1, -1);
    };
    const [encoded] = await exported(h);
    expect(text(encoded!)).toBe(fieldsJson(encoded!));
    // A new state (the agent replaced its cookie jar): the kept record is not written again.
    const entry = h.agent.sessions.get('sess-1')!;
    entry.state.resourcesCookies = { ...entry.state.resourcesCookies, fresh: 'yes' };
    const [newState] = await exported(h);
    expect(text(newState!)).toContain('"fresh":"yes"');
    expect(text(newState!)).toBe(fieldsJson(newState!));
    // A new boundary (the loop ran its tool call and waits on its next model call): encoded anew.
    const second = h.model.holdNext();
    first.gate.open();
    await second.arrived;
    await new Promise((r) => setImmediate(r));
    const [newBoundary] = await exported(h);
    expect(newBoundary!.boundary).toEqual(expect.objectContaining({ step: 1 }));
    expect(text(newBoundary!)).toBe(fieldsJson(newBoundary!));
    expect(text(newBoundary!)).not.toBe(text(newState!));
    second.gate.open();
    expect((await running).status).toBe(200);
  });

  test('a boundary leaves out the turn questions, and a resumed loop rebuilds them', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    // Park after the tool round: hold the second model call, checkpoint there.
    const first = h.model.holdNext();
    const abort = new AbortController();
    const running = activate(h, s, 'r1', 1, abort.signal).catch(() => undefined);
    await first.arrived;
    const second = h.model.holdNext();
    first.gate.open();
    await second.arrived;
    await prepare(h, 'c1');
    await commit(h, 'c1', [ep('r1')]);
    abort.abort();
    second.gate.open();
    await running;
    const next = await freshProcess();
    await restore(next, 'c1', [ep('r1')]);
    const record = (await next.agent.participant!.export(null, new AbortController().signal))[0]!;
    expect(record.boundary).toEqual(expect.objectContaining({ step: 1, question_outputs: [0] }));
    expect(JSON.stringify(record.boundary)).not.toContain('"question"');
    await resume(next, 'c1');
    const before = { model: h.model.calls.length, tools: h.resources.calls.length };
    // Without an index the reply carries the trajectory with every turn's question rebuilt.
    const reply = await activate(next, s, 'r1-a1');
    // It continued after the tool round: one model call, no tool call again.
    expect(h.model.calls.length - before.model).toBe(1);
    expect(h.resources.calls.length - before.tools).toBe(0);
    const turns = (reply.body._ng_trajectory as { turns: { question: { type?: string }[] }[] })
      .turns;
    expect(turns.map((t) => t.question.length)).toEqual([1, 3]);
    expect(turns[1]!.question.map((i) => i.type)).toEqual([
      'message',
      'function_call',
      'function_call_output',
    ]);
  });

  test('an activation continued from its restored boundary keeps its invocation id', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    await activate(h, s, 'r1', 1);
    const held = h.model.holdNext();
    const abort = new AbortController();
    const running = activate(h, s, 'r1', 2, abort.signal).catch(() => undefined);
    await held.arrived;
    await prepare(h, 'c1');
    await commit(h, 'c1', [ep('r1')]);
    abort.abort();
    held.gate.open();
    await running;
    const next = await freshProcess();
    await restore(next, 'c1', [ep('r1')]);
    await resume(next, 'c1');
    // Sent without an index, it continues activation 2 rather than starting a third.
    const reply = await activate(next, s, 'r1-a1');
    expect((reply.body._ng_trajectory as { invocation_id: string }).invocation_id).toBe(
      'activation-2',
    );
  });

  test('a restored activation keeps its boundary through a second checkpoint', async () => {
    h = await startStack();
    const { next } = await checkpointInFirstModelCall();
    // Nobody claimed it yet: a second checkpoint that still continues it exports the same boundary.
    await prepare(next, 'c2');
    const records = await next.agent.participant!.export(
      [ep('r1', 1)],
      new AbortController().signal,
    );
    expect(records).toHaveLength(1);
    expect(records[0]!.boundary).toEqual(expect.objectContaining({ step: 0, new_outputs: [] }));
    await resume(next, 'c2');
  });

  test('a session without a resources cookie jar restores without one', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1', { tools: [] });
    await prepare(h, 'c1');
    await commit(h, 'c1', [ep('r1')]);
    const next = await freshProcess();
    await restore(next, 'c1', [ep('r1')]);
    await resume(next, 'c1');
    const closed = await closeSession(next, s);
    expect(closed.status).toBe(200);
    expect(closed.body.resources_cookies).toBeNull();
  });

  test('a restored session answered with its stored reply survives a commit that leaves its episode out', async () => {
    h = await startStack();
    const { s, next } = await restoredAfterActivation();
    expect((await activate(next, s, 'r1-a1', 1)).status).toBe(200);
    await prepare(next, 'c2');
    expect(await commit(next, 'c2', [])).toEqual([]);
    await resume(next, 'c2');
    expect(next.agent.sessions.get('sess-1')).toBeDefined();
    expect((await closeSession(next, s)).status).toBe(200);
  });

  test('a restored attempt stops being pending at its first use, told to the listeners once', async () => {
    h = await startStack();
    const { s, next } = await restoredAfterActivation();
    const left: string[] = [];
    next.agent.participant!.onRestoredLeft((key) => left.push(key));
    expect(next.agent.participant!.restoredPending()).toEqual([ep('r1', 1)]);
    expect((await activate(next, s, 'r1-a1', 2)).status).toBe(200);
    expect((await activate(next, s, 'r1-a1', 3)).status).toBe(200);
    expect([left, next.agent.participant!.restoredPending()]).toEqual([['r1-a1'], []]);
  });

  test('a commit whose scope leaves out an unclaimed restored session frees it', async () => {
    h = await startStack();
    const { next } = await restoredAfterActivation();
    await prepare(next, 'c2');
    await commit(next, 'c2', []);
    await resume(next, 'c2');
    expect(next.agent.sessions.get('sess-1')).toBeUndefined();
    expect(next.agent.participant!.restoredPending()).toEqual([]);
  });

  test('a commit scope matches a restored session by attempt, not by rollout alone', async () => {
    h = await startStack();
    const { next } = await restoredAfterActivation();
    await prepare(next, 'c2');
    // The replaced attempt r1 names the rollout, but not the session's attempt r1-a1.
    expect(await commit(next, 'c2', [ep('r1'), ep('r1', 2)])).toEqual([]);
    await resume(next, 'c2');
    const again = await freshProcess();
    await restore(again, 'c1', [ep('r1')]);
    await resume(again, 'c1');
    await prepare(again, 'c3');
    expect(await commit(again, 'c3', [ep('r1'), ep('r1', 1)])).toEqual(['r1-a1']);
    await resume(again, 'c3');
  });

  test('a commit does not export live sessions outside its scope', async () => {
    h = await startStack();
    await seed(h, 'sess-1', 'r1');
    await seed(h, 'sess-2', 'r2');
    await prepare(h, 'c1');
    expect(await commit(h, 'c1', [ep('r2')])).toEqual(['r2']);
    await resume(h, 'c1');
  });

  test('a restored session’s direct HTTP tool call goes under the replacement prefix with the restored jar', async () => {
    h = await startStack();
    const { s, next } = await restoredAfterActivation();
    await activate(next, s, 'r1-a1', 2);
    expect(h.resources.calls.map((c) => [c.key, c.cookie])).toEqual([
      ['r1', 'res_session=seeded'],
      ['r1-a1', 'res_session=r1'],
    ]);
  });

  test('a restore is refused while the process holds live sessions', async () => {
    h = await startStack();
    await seed(h, 'sess-1', 'r1');
    await prepare(h, 'c1');
    await commit(h, 'c1', [ep('r1')]);
    await resume(h, 'c1');
    const reply = await restore(h, 'c1', [ep('r1')]);
    expect(reply.status).toBe(409);
  });

  test('a restored session whose state is not JSON restores; its first use is a typed error naming it, the others work', async () => {
    h = await startStack();
    const one = await seed(h, 'sess-1', 'r1');
    const two = await seed(h, 'sess-2', 'r2');
    await activate(h, one, 'r1', 1);
    await activate(h, two, 'r2', 1);
    await prepare(h, 'c1');
    await commit(h, 'c1', [ep('r1'), ep('r2')]);
    // The store writes the copy: its digest, count and episodes are right, r1's state is not JSON.
    // Past DEFER_DECODE_MIN_BYTES: a smaller record is decoded (and refused) at restore.
    await copyWithSessionOfR1(`{"request":tru,"pad":"${'x'.repeat(20_000)}"}`);
    const next = await freshProcess();
    expect((await restore(next, 'c2', [ep('r1'), ep('r2')])).status).toBe(200);
    await resume(next, 'c2');
    for (let i = 0; i < 2; i++) {
      const broken = await activate(next, one, 'r1-a1', 2);
      expect(errorCode(broken)).toBe('invalid_checkpoint_state');
      expect(JSON.stringify(broken.body)).toContain("'r1'");
    }
    expect((await activate(next, two, 'r2-a1', 2)).status).toBe(200);
    // Unclaimed, the broken session is exported as it was read: the state stays what it was.
    const records = await next.agent.participant!.export(null, new AbortController().signal);
    const exported = records.find((r) => r.session_key === 'sess-1')!;
    expect(exported[RECORD_FIELDS_JSON]!.map((p) => Buffer.from(p).toString()).join('')).toContain(
      '"session":{"request":tru,"pad":',
    );
  });
});

/** An activation whose input holds an integer past 2^53 (JSON.parse reads it as a float). */
function activateWith(h: { url: string }, s: Seeded, key: string, index: number) {
  return post(
    `${h.url}/ng-rollout/${key}/v1/responses`,
    {
      input: [{ role: 'user', type: 'message', content: 'weather?', seq: 2 ** 63 }],
      tools: [{ type: 'function', name: 'get_weather', parameters: {} }],
    },
    { cookie: s.cookie, 'x-ng-agent-activation': String(index) },
  );
}

/** The record lines a commit wrote for the agent, by session key. */
async function recordLines(h: Harness, id: string): Promise<Map<string, string>> {
  const dir = participantDir(join(h.dir, id), 'agent', 'simple_agent');
  const manifest = JSON.parse(await readFile(join(dir, 'manifest.json'), 'utf8')) as JsonObject;
  const text = await readFile(join(dir, manifest.records_file as string), 'utf8');
  const lines = new Map<string, string>();
  for (const line of text.split('\n').filter((l) => l.length > 0)) {
    const record = decodeJson(line) as JsonObject;
    lines.set(record.session_key as string, line);
  }
  return lines;
}

/**
 * What encoding the session as the agent holds it now gives for its record line: the state last,
 * so a restore reads the other fields without walking it.
 */
function expectedLine(h: Harness, key: string, episode: { rollout_id: string; attempt: number }) {
  const entry = h.agent.sessions.get(key)!;
  return encodeJson({
    episode_id: episode,
    session_key: key,
    boundary: null,
    episode: null,
    session: exportSession(entry),
  });
}

async function exported(h: Harness): Promise<AgentSessionRecord[]> {
  return h.agent.participant!.export(null, new AbortController().signal) as Promise<
    AgentSessionRecord[]
  >;
}

/** The byte pieces of a record (what the agent encoded ahead, not text made for this commit). */
function bytePieces(record: AgentSessionRecord): Uint8Array[] {
  return (record[RECORD_FIELDS_JSON] ?? []).filter((p): p is Uint8Array => typeof p !== 'string');
}

/** The same bytes in memory (a view of them, not an equal copy). */
function sameMemory(a: Uint8Array, b: Uint8Array): boolean {
  return a.buffer === b.buffer && a.byteOffset === b.byteOffset && a.length === b.length;
}

describe('agent sessions encoded once', () => {
  test('a session’s messages are encoded once, when added: every export after hands the store the same bytes', async () => {
    h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    expect((await activateWith(h, s, 'r1', 1)).status).toBe(200);
    const first = bytePieces((await exported(h))[0]!);
    const trajectory = encodeJson(h.agent.sessions.get('sess-1')!.state.observations[0]!);
    const kept = first.find((p) => Buffer.from(p).toString() === trajectory);
    expect(kept).toBeDefined();
    // The session grows in place (a second trajectory): the first one's bytes are not made again.
    expect((await activateWith(h, s, 'r1', 2)).status).toBe(200);
    const second = bytePieces((await exported(h))[0]!);
    expect(second.some((p) => sameMemory(p, kept!))).toBe(true);
    expect(h.agent.sessions.get('sess-1')!.state.observations).toHaveLength(2);
  });

  test('a committed record is exactly encodeJson of the session, as it grew in place and after a restore, NaN, -Infinity and big integers included', async () => {
    h = await startStack();
    const one = await seed(h, 'sess-1', 'r1');
    const two = await seed(h, 'sess-2', 'r2');
    for (const index of [1, 2]) expect((await activateWith(h, one, 'r1', index)).status).toBe(200);
    expect((await activateWith(h, two, 'r2', 1)).status).toBe(200);
    await prepare(h, 'c1');
    await commit(h, 'c1', [ep('r1'), ep('r2')]);
    const lines = await recordLines(h, 'c1');
    expect(lines.get('sess-1')).toBe(expectedLine(h, 'sess-1', ep('r1')));
    expect(lines.get('sess-2')).toBe(expectedLine(h, 'sess-2', ep('r2')));
    expect(lines.get('sess-1')).toContain('"seq":9223372036854776000.0');
    await resume(h, 'c1');

    // A checkpoint (NeMo Gym's, say) whose r1 observations hold what JSON.parse cannot read.
    const session = (decodeJson(lines.get('sess-1')!) as JsonObject).session as Record<
      string,
      JsonValue
    >;
    const observations = session.observations as JsonObject[];
    observations[0] = { ...observations[0]!, score: NaN, low: -Infinity, id: 2n ** 64n + 1n };
    await copyWithSessionOfR1(encodeJson(session));
    const next = await freshProcess();
    expect((await restore(next, 'c2', [ep('r1'), ep('r2')])).status).toBe(200);
    await resume(next, 'c2');
    // Used: its restored messages are kept as they are, and a new one is appended in place.
    expect((await activateWith(next, one, 'r1-a1', 3)).status).toBe(200);
    await prepare(next, 'c3');
    await commit(next, 'c3', [ep('r1', 1), ep('r2', 1)]);
    const restored = await recordLines(next, 'c3');
    expect(restored.get('sess-1')).toBe(expectedLine(next, 'sess-1', ep('r1', 1)));
    expect(restored.get('sess-1')).toContain(
      '"score":NaN,"low":-Infinity,"id":18446744073709551617',
    );
    expect(next.agent.sessions.get('sess-1')!.state.observations).toHaveLength(3);
    // Never used (a record this small is decoded at restore): encoded as restored, under r2-a1.
    expect(restored.get('sess-2')).toBe(expectedLine(next, 'sess-2', ep('r2', 1)));
  });
});
