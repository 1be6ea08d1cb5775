/**
 * Token lineage and generation cuts over real HTTP: the policy model server in front of the fake
 * backend, which stages tokens through core's worker helpers and serves the cut route.
 */
import { once } from 'node:events';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';

import { afterEach, describe, expect, it } from '@jest/globals';
import {
  FINGERPRINT_VERSION,
  assistantFingerprint,
  conversationDigest,
} from '@ckpt-gym/core/capture';
import { createHttpClients } from '@ckpt-gym/core/client';
import { deadline, episodes, until } from '@ckpt-gym/testing';

import { type CutRecord, GenerationCuts } from '../src/cuts.js';
import { cutRestartReason, resolveParent } from '../src/lineage.js';
import type { Ticket } from '../src/gate.js';

import {
  CHAT_BODY,
  chat,
  CUT_RECORD,
  cleanup,
  control,
  fakeCalls,
  fakeCtl,
  type Harness,
  post,
  startFake,
  startHarness,
  tempDir,
  TOKEN,
} from './support.js';

afterEach(cleanup);

const CUTS = ', checkpoint_generation_cuts: true';

type Message = Record<string, unknown>;

/** The conversation after the first (tool-call) turn: its answer and a tool result. */
function toolTurn(first: { choices: { message: Message }[] }): {
  model: string;
  messages: Message[];
} {
  const answer = first.choices[0]!.message;
  const call = (answer.tool_calls as { id: string }[])[0]!;
  return {
    model: 'fake-model',
    messages: [
      ...CHAT_BODY.messages,
      answer,
      { role: 'tool', tool_call_id: call.id, content: '{"temp": 12}' },
    ],
  };
}

/** A chat call the test can abort (the client going away before the response starts). */
function abortableChat(url: string, key: string, body: object) {
  const controller = new AbortController();
  const done = fetch(`${url}/ng-rollout/${key}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
    signal: controller.signal,
  }).then(
    async (res) => ({ status: res.status, body: (await res.json()) as unknown }),
    () => ({ status: 0, body: undefined }),
  );
  return { done, abort: () => controller.abort() };
}

async function manifest(h: Harness, key: string) {
  const res = await fetch(`${h.url}/training-token-capture/control/rollouts/${key}/manifest`, {
    headers: { authorization: `Bearer ${TOKEN}` },
  });
  expect(res.status).toBe(200);
  return (await res.json()) as {
    rollout_id: string;
    records: Record<string, unknown>[];
    failures: Record<string, unknown>[];
  };
}

async function rebuild(h: Harness, key: string) {
  return post(`${h.fake.url}/_ctl/rebuild`, { manifest: await manifest(h, key) });
}

async function prepare(h: Harness, id: string, seconds = 30) {
  return control(h.url, 'prepare', { checkpoint_id: id, deadline_ts: deadline(seconds) });
}

async function commit(h: Harness, id: string, dir: string, scope: string[]) {
  return control(h.url, 'commit', {
    checkpoint_id: id,
    deadline_ts: deadline(),
    checkpoint_dir: dir,
    episode_ids: episodes(...scope),
  });
}

const resume = (h: Harness, id: string) =>
  control(h.url, 'resume', { checkpoint_id: id, deadline_ts: deadline() });

async function restore(h: Harness, id: string, dir: string, scope: string[]) {
  const reply = await control(h.url, 'restore', {
    checkpoint_id: id,
    deadline_ts: deadline(),
    checkpoint_dir: dir,
    episode_ids: episodes(...scope),
  });
  expect(reply.body).toMatchObject({ phase: 'restored' });
  await resume(h, id);
}

async function callsOf(h: Harness, key: string) {
  return (await fakeCalls(h.fake)).filter((c) => c.capture_key === key);
}

describe('token lineage', () => {
  it('a tool turn continues its parent’s chain and the rollout rebuilds root first', async () => {
    const h = await startHarness();
    const first = await chat(h.url, 'r');
    const second = await chat(h.url, 'r', toolTurn(first.body as never));
    expect(second.status).toBe(200);
    const [root, child] = await callsOf(h, 'r');
    expect(root!.admission).toMatchObject({ mode: 'text', parent_call_id: null });
    const rootId = (root!.admission as { model_call_id: string }).model_call_id;
    expect(child!.admission).toMatchObject({ mode: 'token_in', parent_call_id: rootId });
    const rebuilt = await rebuild(h, 'r');
    expect(rebuilt.status).toBe(200);
    expect(rebuilt.body).toMatchObject({
      call_ids: [rootId, (child!.admission as { model_call_id: string }).model_call_id],
    });
  });

  it('an unresolved continuation with ledger rows is a failure row with no admission, never a root', async () => {
    const h = await startHarness();
    await chat(h.url, 'r');
    const forged = {
      model: 'fake-model',
      messages: [
        ...CHAT_BODY.messages,
        { role: 'assistant', content: 'an answer this rollout never got' },
        { role: 'user', content: 'and?' },
      ],
    };
    expect((await chat(h.url, 'r', forged)).status).toBe(200);
    const calls = await callsOf(h, 'r');
    expect(calls[1]!.admission).toBeNull();
    const { records, failures } = await manifest(h, 'r');
    expect(records).toHaveLength(1);
    expect(failures).toEqual([{ model_call_id: expect.any(String), reason: 'unresolved_parent' }]);
  });

  it('a Responses API tool turn resolves its parent too', async () => {
    const h = await startHarness();
    const input: unknown[] = [{ role: 'user', content: 'weather?' }];
    const first = await post(`${h.url}/ng-rollout/r/v1/responses`, { model: 'fake-model', input });
    const output = (first.body as { output: { type: string; call_id?: string }[] }).output;
    const call = output.find((item) => item.type === 'function_call')!;
    const next = [
      ...input,
      ...output,
      { type: 'function_call_output', call_id: call.call_id, output: '{"temp": 12}' },
    ];
    expect(
      (await post(`${h.url}/ng-rollout/r/v1/responses`, { model: 'fake-model', input: next }))
        .status,
    ).toBe(200);
    const [root, child] = await callsOf(h, 'r');
    const rootId = (root!.admission as { model_call_id: string }).model_call_id;
    expect(child!.admission).toMatchObject({ mode: 'token_in', parent_call_id: rootId });
    expect((await manifest(h, 'r')).failures).toEqual([]);
  });

  it('a continuation in a rollout without rows is a root', async () => {
    const h = await startHarness();
    const first = await chat(h.url, 'other');
    expect((await chat(h.url, 'r', toolTurn(first.body as never))).status).toBe(200);
    const [call] = await callsOf(h, 'r');
    expect(call!.admission).toMatchObject({ mode: 'text' });
  });
});

describe('generation cuts', () => {
  const hung: Server[] = [];
  afterEach(async () => {
    for (const server of hung.splice(0)) {
      server.closeAllConnections();
      server.close();
    }
  });

  it('a hung cut leaves the rest of the prepare deadline', async () => {
    const server = createServer(() => undefined); // accepts and never answers
    hung.push(server);
    server.listen(0, '127.0.0.1');
    await once(server, 'listening');
    const { port } = server.address() as AddressInfo;
    const h = await startHarness({
      extra: `${CUTS}, generation_cut_control_url: "http://127.0.0.1:${port}/cut"`,
    });
    await fakeCtl(h.fake, 'hold', { after_calls: 0, after_tokens: 1 });
    const held = chat(h.url, 'r');
    await until(async () => (await fakeCalls(h.fake)).length === 1, 'the held call');
    const deadlineTs = deadline(6);
    const prepared = await control(h.url, 'prepare', {
      checkpoint_id: 'c1',
      deadline_ts: deadlineTs,
    });
    // The cut got half of the time left; the stages after the model still have the rest.
    expect(Date.now() / 1000).toBeLessThan(deadlineTs);
    expect(prepared.body).toMatchObject({
      phase: 'prepared',
      report: { counts: { cut_failures: 1 } },
    });
    await resume(h, 'c1');
    await fakeCtl(h.fake, 'release');
    expect((await held).status).toBe(200);
  });

  it('the cut round is its own prepare stage: the stage histogram counts cut_round', async () => {
    const h = await startHarness({ extra: CUTS });
    await fakeCtl(h.fake, 'hold', { after_calls: 0, after_tokens: 1 });
    const held = chat(h.url, 'r');
    await until(async () => (await fakeCalls(h.fake)).length === 1, 'the held call');
    expect((await prepare(h, 'c1')).body).toMatchObject({ phase: 'prepared' });
    const cuts = (await fetch(`${h.fake.url}/_ctl/cuts`).then((r) => r.json())) as {
      cuts: unknown[];
    };
    expect(cuts.cuts).toHaveLength(1);
    const metrics = await fetch(`${h.url}/metrics`).then((r) => r.text());
    const counted = metrics
      .split('\n')
      .filter((line) => line.startsWith('gym_checkpoint_stage_duration_ms_count{'))
      .filter((line) => line.includes('operation="prepare"') && line.includes('stage="cut_round"'));
    expect(counted).toEqual([expect.stringMatching(/ 1$/)]);
    await resume(h, 'c1');
    await fakeCtl(h.fake, 'release');
    expect((await held).status).toBe(200);
  });

  it('a call with constrained decoding is never cut', async () => {
    const h = await startHarness({ extra: CUTS });
    await fakeCtl(h.fake, 'hold', { after_calls: 0, after_tokens: 1 });
    const held = chat(h.url, 'r', { ...CHAT_BODY, tool_choice: 'required' });
    await until(async () => (await fakeCalls(h.fake)).length === 1, 'the held call');
    const prepared = await prepare(h, 'c1');
    expect(prepared.body).toMatchObject({
      phase: 'prepared',
      report: { counts: { cut_skipped: 1 } },
    });
    const cuts = await fetch(`${h.fake.url}/_ctl/cuts`).then((r) => r.json());
    expect(cuts).toEqual({ cuts: [] });
    await resume(h, 'c1');
    await fakeCtl(h.fake, 'release');
    expect((await held).status).toBe(200);
  });

  it('a resumed call that continues a restored cut is cut again by the next checkpoint and its retry continues the newer cut; restoring the first checkpoint again drops the dead run’s calls', async () => {
    const fake = await startFake();
    const captureDir = await tempDir();
    const first = await startHarness({ fake, captureDir, extra: CUTS });
    const answer = await chat(first.url, 'r');
    const turn = toolTurn(answer.body as never);
    // Every later call generates 2 tokens, then waits: in flight mid-generation.
    await fakeCtl(fake, 'hold', { after_calls: 1, after_tokens: 2 });
    const dead = abortableChat(first.url, 'r', turn);
    await until(async () => (await fakeCalls(fake)).length === 2, 'the held call');
    const c1 = await tempDir();
    expect((await prepare(first, 'c1')).body).toMatchObject({ phase: 'prepared' });
    expect(await fetch(`${fake.url}/_ctl/cuts`).then((r) => r.json())).toEqual({
      cuts: [[expect.any(String)]],
    });
    const committed = await commit(first, 'c1', c1, ['r']);
    expect(committed.body).toMatchObject({
      staging_keys_by_episode: {
        r: expect.arrayContaining([expect.stringMatching(/^__generation_cut__\//)]),
      },
    });
    // Crash: every gym process dies; the backend and its token store live on.
    await first.close();
    await dead.done;
    const [, cutCall] = await fakeCalls(fake);
    const cutId = (cutCall!.admission as { model_call_id: string }).model_call_id;

    const second = await startHarness({ fake, captureDir, extra: CUTS });
    await restore(second, 'c1', c1, ['r']);
    const resumed = abortableChat(second.url, 'r-a1', turn);
    await until(async () => (await callsOf(second, 'r-a1')).length === 1, 'the resumed call');
    const [continued] = await callsOf(second, 'r-a1');
    expect(continued).toMatchObject({ continued_from: cutId, reused_prefix_tokens: 2 });
    const continuedId = (continued!.admission as { model_call_id: string }).model_call_id;

    // The next checkpoint cuts the resumed call again and exports the newer cut.
    const c2 = await tempDir();
    expect((await prepare(second, 'c2')).body).toMatchObject({ phase: 'prepared' });
    expect((await commit(second, 'c2', c2, ['r-a1'])).status).toBe(200);
    await resume(second, 'c2');
    // The call ends before its response starts; its retry continues the newer cut.
    resumed.abort();
    await resumed.done;
    await until(async () => (await callsOf(second, 'r-a1'))[0]!.dropped === true, 'the drop');
    const retry = chat(second.url, 'r-a1', turn);
    await until(async () => (await callsOf(second, 'r-a1')).length === 2, 'the retry');
    const [, retried] = await callsOf(second, 'r-a1');
    expect(retried).toMatchObject({ continued_from: continuedId, reused_prefix_tokens: 4 });
    await fakeCtl(fake, 'release');
    expect((await retry).status).toBe(200);
    const retriedId = (retried!.admission as { model_call_id: string }).model_call_id;
    const rootId = (await manifest(second, 'r-a1')).records[0]!.model_call_id;
    expect((await rebuild(second, 'r-a1')).body).toMatchObject({ call_ids: [rootId, retriedId] });

    // Crash again and restore the first checkpoint: the replacement's calls are gone.
    await second.close();
    const third = await startHarness({ fake, captureDir, extra: CUTS });
    await restore(third, 'c1', c1, ['r']);
    const again = await chat(third.url, 'r-a1', turn);
    expect(again.status).toBe(200);
    const [, , lastCall] = await callsOf(third, 'r-a1');
    expect(lastCall).toMatchObject({ continued_from: cutId, reused_prefix_tokens: 2 });
    const lastId = (lastCall!.admission as { model_call_id: string }).model_call_id;
    const rebuilt = await rebuild(third, 'r-a1');
    expect(rebuilt.body).toMatchObject({ call_ids: [rootId, lastId] });
    const { records, failures } = await manifest(third, 'r-a1');
    expect(records.map((row) => row.model_call_id)).toEqual([rootId, lastId]);
    expect(failures).toEqual([]);
  });

  it('an unclaimed restored cut is exported again while the scope continues its episode', async () => {
    const fake = await startFake();
    const captureDir = await tempDir();
    const first = await startHarness({ fake, captureDir, extra: CUTS });
    const turn = toolTurn((await chat(first.url, 'r')).body as never);
    await fakeCtl(fake, 'hold', { after_calls: 1, after_tokens: 2 });
    const dead = abortableChat(first.url, 'r', turn);
    await until(async () => (await fakeCalls(fake)).length === 2, 'the held call');
    const c1 = await tempDir();
    await prepare(first, 'c1');
    await commit(first, 'c1', c1, ['r']);
    await first.close();
    await dead.done;

    const second = await startHarness({ fake, captureDir, extra: CUTS });
    await restore(second, 'c1', c1, ['r']);
    const c2 = await tempDir();
    await prepare(second, 'c2');
    const committed = await commit(second, 'c2', c2, ['r-a1']);
    const keys = (committed.body as { staging_keys_by_episode: Record<string, string[]> })
      .staging_keys_by_episode['r-a1'];
    expect(keys).toEqual(expect.arrayContaining([expect.stringMatching(/^__generation_cut__\//)]));
    await resume(second, 'c2');
    await fakeCtl(fake, 'release');
  });
});

describe('kept cuts (unit)', () => {
  const clients = createHttpClients();
  afterEach(() => clients.close());
  const cuts = () =>
    new GenerationCuts({
      serverName: 'policy',
      url: 'http://127.0.0.1:9/cut',
      token: 't',
      control: clients.control,
      logger: {
        error: () => undefined,
        warn: () => undefined,
        info: () => undefined,
        debug: () => undefined,
        child() {
          return this;
        },
      },
    });
  const record: CutRecord = CUT_RECORD;
  const ticket = (id: string): Ticket => ({
    id,
    episode: { rollout_id: 'r', attempt: 1 },
    captureKey: 'r-a1',
    admittedAt: 2,
    signal: new AbortController().signal,
    responseStarted: false,
  });
  const call = (id: string, extra: object = {}) => ({
    ticket: ticket(id),
    requestDigest: 'd',
    restartReason: null,
    captured: true,
    ...extra,
  });

  it('a restored cut is kept until the call that used it delivers its response', () => {
    const kept = cuts();
    kept.install('r-a1', record);
    expect(kept.register(call('t1'))).toEqual(record.continuation);
    // In use: a concurrent call with the same request regenerates.
    expect(kept.register(call('t2'))).toBeNull();
    kept.left(ticket('t1'));
    kept.left(ticket('t2'));
    expect(kept.exportCut('r-a1')).toEqual(record);
    expect(kept.register(call('t3'))).toEqual(record.continuation);
    kept.delivered(ticket('t3'));
    expect(kept.exportCut('r-a1')).toBeUndefined();
  });

  it('a call with another request or constrained decoding does not continue a restored cut', () => {
    const kept = cuts();
    kept.install('r-a1', record);
    expect(kept.register(call('t1', { requestDigest: 'other' }))).toBeNull();
    expect(kept.register(call('t2', { restartReason: 'tool_choice:required' }))).toBeNull();
    expect(kept.exportCut('r-a1')).toEqual(record);
  });

  it('retire and deleteRestored drop a kept cut', () => {
    const kept = cuts();
    kept.install('r-a1', record);
    kept.retire({ rollout_id: 'r', attempt: 1 });
    expect(kept.exportCut('r-a1')).toBeUndefined();
    kept.install('r-a1', record);
    kept.drop('r-a1');
    expect(kept.keptCount).toBe(0);
  });
});

describe('lineage rules (unit)', () => {
  const user = { role: 'user', content: 'q' };
  const answer = { role: 'assistant', content: 'a' };

  it('a parent row without a chain hash cannot admit a child', () => {
    const context = [user, answer];
    const row = {
      model_call_id: 'c1',
      output_fingerprint: assistantFingerprint(context),
      fingerprint_version: FINGERPRINT_VERSION,
      context_len: 2,
      context_digest: conversationDigest(context),
      cum_len: 3,
      cumulative_hash: 'h',
      staging_chain: ['r/c1'],
      chain_hash: null,
    };
    const next = [user, answer, { role: 'user', content: 'more' }];
    expect(resolveParent([row], next)).toEqual({
      kind: 'unresolved',
      reason: 'parent_missing_chain_hash',
    });
    expect(resolveParent([{ ...row, chain_hash: 'c' }], next)).toMatchObject({ kind: 'resolved' });
    // Another fingerprint version never matches.
    expect(resolveParent([{ ...row, chain_hash: 'c', fingerprint_version: 0 }], next)).toEqual({
      kind: 'unresolved',
      reason: 'unresolved_parent',
    });
  });

  it('constrained decoding has a restart reason; auto, none and text do not', () => {
    expect(cutRestartReason({ tool_choice: 'auto', response_format: { type: 'text' } })).toBeNull();
    expect(cutRestartReason({ tool_choice: 'none' })).toBeNull();
    expect(cutRestartReason({ tool_choice: 'required' })).toBe('tool_choice:required');
    expect(cutRestartReason({ tool_choice: { type: 'function' } })).toBe('tool_choice:constrained');
    expect(cutRestartReason({ response_format: { type: 'json_schema' } })).toBe(
      'response_format:json_schema',
    );
    expect(cutRestartReason({ response_format: 'x' })).toBe('response_format:unknown');
    expect(cutRestartReason({ guided_regex: 'a+' })).toBe('guided_regex');
    expect(cutRestartReason({ structured_outputs: {} })).toBe('structured_outputs');
  });
});
