import { deadline, episodes, until } from '@ckpt-gym/testing';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';

import { afterEach, describe, expect, it, jest } from '@jest/globals';

import { PolicyGate } from '../src/index.js';
import {
  CHAT_BODY,
  chat,
  cleanup,
  control,
  fakeCalls,
  fakeCtl,
  rawCall,
  startFake,
  startHarness,
} from './support.js';

afterEach(cleanup);

const r = (attempt = 0) => ({ rollout_id: 'r', attempt });
const settled = async (p: Promise<unknown>): Promise<boolean> => {
  let done = false;
  p.then(
    () => (done = true),
    () => (done = true),
  );
  await new Promise((resolve) => setImmediate(resolve));
  return done;
};
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

describe('PolicyGate', () => {
  it('a waiting call is not admitted, not counted and never a blocker', async () => {
    const gate = new PolicyGate();
    gate.close();
    const waiting = gate.admit(r());
    expect(await settled(waiting)).toBe(false);
    expect(gate.waitingCount).toBe(1);
    expect(gate.inflight).toBe(0);
    expect(gate.ready).toBe(true);
    gate.open();
    const ticket = await waiting;
    expect(gate.inflight).toBe(1);
    gate.exit(ticket);
  });

  it('marking an attempt refuses its waiting calls at once, and for good after forget', async () => {
    const gate = new PolicyGate();
    gate.close();
    const covered = gate.admit(r(1));
    const later = gate.admit(r(2));
    await settled(covered);
    gate.marks.mark([r(1)]);
    await expect(covered).rejects.toMatchObject({ code: 'stale_attempt' });
    // No retire ran (as when a retire is cut short by its deadline) and the mark is forgotten:
    gate.marks.forget(['r']);
    gate.open();
    const ticket = await later;
    expect(ticket.captureKey).toBe('r-a2');
    gate.exit(ticket);
  });

  it('retire returns only after the waiting calls left the gate refused', async () => {
    const gate = new PolicyGate();
    gate.close();
    const order: string[] = [];
    const waiting = gate.admit(r()).catch((err: { code: string }) => order.push(err.code));
    await settled(waiting);
    await gate.retire(r());
    order.push('retired');
    await waiting;
    expect(order).toEqual(['stale_attempt', 'retired']);
    expect(gate.waitingCount).toBe(0);
  });

  it('a retried retire waits for a call an earlier retire cancelled without cancelling it again', async () => {
    const gate = new PolicyGate();
    const ticket = await gate.admit(r(1));
    let aborts = 0;
    ticket.signal.addEventListener('abort', () => (aborts += 1));
    const first = gate.retire(r(1));
    const again = gate.retire(r(2));
    expect(aborts).toBe(1);
    expect(ticket.signal.reason).toMatchObject({ code: 'stale_attempt' });
    expect(await settled(first)).toBe(false);
    expect(await settled(again)).toBe(false);
    gate.exit(ticket);
    await Promise.all([first, again]);
    expect(aborts).toBe(1);
  });

  it('untagged calls are admitted, never retired and never attributed', async () => {
    const gate = new PolicyGate();
    gate.marks.mark([r(5)]);
    const ticket = await gate.admit(undefined);
    expect(ticket.captureKey).toBeUndefined();
    await gate.retire(r(5));
    expect(ticket.signal.aborted).toBe(false);
    expect(gate.undeliveredCallIds().size).toBe(0);
    gate.exit(ticket);
  });

  it('ready means no response is streaming: held responses never block', async () => {
    const gate = new PolicyGate();
    const streaming = await gate.admit(r());
    const held = await gate.admit(r(1));
    await gate.deliver(streaming);
    gate.close();
    expect(gate.ready).toBe(false);
    expect(gate.streamingKeys()).toEqual(['r']);
    const holding = gate.deliver(held);
    expect(await settled(holding)).toBe(false);
    gate.exit(streaming);
    expect(gate.ready).toBe(true);
    expect(gate.held).toBe(1);
    gate.open();
    await holding;
    gate.exit(held);
  });
});

describe('the gate over HTTP', () => {
  it('a call that arrives during a checkpoint waits for resume without being admitted', async () => {
    const h = await startHarness();
    const prepared = await control(h.url, 'prepare', {
      checkpoint_id: 'c1',
      deadline_ts: deadline(),
    });
    expect(prepared.body).toMatchObject({ phase: 'prepared' });
    const call = chat(h.url, 'r');
    await until(() => h.server.gate.waitingCount === 1, 'the call to wait');
    const status = await fetch(`${h.url}/ng-control/v1/checkpoint/status`, {
      headers: { authorization: 'Bearer tok' },
    });
    expect(await status.json()).toMatchObject({ report: { counts: { inflight: 0, held: 0 } } });
    expect(await fakeCalls(h.fake)).toEqual([]);
    await control(h.url, 'resume', { checkpoint_id: 'c1', deadline_ts: deadline() });
    expect((await call).status).toBe(200);
    expect(await fakeCalls(h.fake)).toHaveLength(1);
  });

  it('holds a response whose generation finished during a checkpoint: no status, header or byte until resume', async () => {
    const h = await startHarness();
    await fakeCtl(h.fake, 'hold', { after_calls: 0 });
    const call = rawCall(h.url, '/ng-rollout/r/v1/chat/completions', {
      model: 'fake-model',
      messages: [{ role: 'user', content: 'q' }],
    });
    await until(async () => (await fakeCalls(h.fake)).length === 1, 'the backend to see the call');
    const prepared = await control(h.url, 'prepare', {
      checkpoint_id: 'c1',
      deadline_ts: deadline(),
    });
    expect(prepared.body).toMatchObject({
      phase: 'prepared',
      report: { ready: true, counts: { inflight: 1, held: 1 } },
    });
    await fakeCtl(h.fake, 'release');
    await until(
      async () => (await fakeCalls(h.fake))[0]?.returned === true,
      'the backend to answer',
    );
    await sleep(100);
    expect(call.state.head).toBeUndefined();
    await control(h.url, 'resume', { checkpoint_id: 'c1', deadline_ts: deadline() });
    await call.finished;
    expect(call.state.head?.statusCode).toBe(200);
    expect(JSON.parse(call.state.text)).toMatchObject({ object: 'chat.completion' });
  });

  it('keep-alive comments of a held event stream start nothing; its output is held until resume', async () => {
    const fake = await startFake(10);
    const h = await startHarness({ fake });
    await fakeCtl(h.fake, 'hold', { after_calls: 0 });
    const call = rawCall(h.url, '/ng-rollout/r/v1/chat/completions', {
      model: 'fake-model',
      stream: true,
      messages: [{ role: 'user', content: 'q' }],
    });
    await until(async () => (await fakeCalls(h.fake)).length === 1, 'the backend to see the call');
    await sleep(50); // keep-alives flow from the backend meanwhile
    expect(call.state.head).toBeUndefined();
    const prepared = await control(h.url, 'prepare', {
      checkpoint_id: 'c1',
      deadline_ts: deadline(),
    });
    expect(prepared.body).toMatchObject({ phase: 'prepared', report: { counts: { held: 1 } } });
    await fakeCtl(h.fake, 'release');
    await until(
      async () => (await fakeCalls(h.fake))[0]?.returned === true,
      'the backend to answer',
    );
    await sleep(50);
    expect(call.state.head).toBeUndefined();
    await control(h.url, 'resume', { checkpoint_id: 'c1', deadline_ts: deadline() });
    await call.finished;
    expect(call.state.text).toContain('data: [DONE]');
    expect(call.state.text).not.toContain(': keep-alive');
  });

  it('an event stream that already started finishes while admission is closed, and blocks readiness until then', async () => {
    let finish!: () => void;
    const finished = new Promise<void>((resolve) => (finish = resolve));
    const backend: Server = createServer((req, res) => {
      req.resume();
      res.writeHead(200, { 'content-type': 'text/event-stream' });
      const chunk = (content: string) =>
        `data: ${JSON.stringify({ id: 'x', object: 'chat.completion.chunk', choices: [{ index: 0, delta: { content } }] })}\n\n`;
      res.write(chunk('first '));
      void finished.then(() => res.end(`${chunk('last')}data: [DONE]\n\n`));
    });
    await new Promise<void>((resolve) => backend.listen(0, '127.0.0.1', resolve));
    const port = (backend.address() as AddressInfo).port;
    try {
      const h = await startHarness({
        backendUrl: `http://127.0.0.1:${port}/v1`,
        extra: ', forward_rollout_prefix: false',
      });
      const call = rawCall(h.url, '/ng-rollout/r/v1/chat/completions', {
        stream: true,
        messages: [{ role: 'user', content: 'q' }],
      });
      await until(() => call.state.text.includes('first'), 'the first chunk');
      const notReady = await control(h.url, 'prepare', {
        checkpoint_id: 'c1',
        deadline_ts: Date.now() / 1000 + 0.3,
      });
      expect(notReady.body).toMatchObject({
        phase: 'preparing',
        report: { ready: false, blockers: ['r'], blocker_count: 1 },
      });
      finish();
      await call.finished;
      expect(call.state.text).toContain('last');
      const ready = await control(h.url, 'prepare', {
        checkpoint_id: 'c1',
        deadline_ts: deadline(),
      });
      expect(ready.body).toMatchObject({ phase: 'prepared' });
    } finally {
      finish();
      backend.closeAllConnections();
      await new Promise((resolve) => backend.close(resolve));
    }
  });

  it('retire cancels a running generation before it replies, with stale_attempt for the caller', async () => {
    const h = await startHarness();
    await fakeCtl(h.fake, 'hold', { after_calls: 0 });
    const call = chat(h.url, 'r');
    await until(async () => (await fakeCalls(h.fake)).length === 1, 'the backend to see the call');
    const retired = await control(h.url, 'retire', {
      checkpoint_id: 'c0',
      deadline_ts: deadline(),
      episode_ids: episodes('r'),
    });
    expect(retired.body).toEqual({ retired_count: 1 });
    expect(h.server.gate.inflight).toBe(0);
    const reply = await call;
    expect(reply.status).toBe(409);
    expect(reply.body).toMatchObject({ error: { code: 'stale_attempt' } });
  });

  it('a call that fails right after admission releases its ticket, and a retire of it completes', async () => {
    const h = await startHarness();
    // A poisoned call: serialising its checked body throws, as a 10,000-level body once did.
    const poison = { ...CHAT_BODY, messages: [{ role: 'user', content: 'poison' }] };
    const stringify = JSON.stringify;
    const spy = jest.spyOn(JSON, 'stringify').mockImplementation(((value: unknown, ...rest) => {
      const messages = (value as { messages?: { content?: unknown }[] } | null)?.messages;
      if (value !== poison && messages?.[0]?.content === 'poison') {
        throw new RangeError('Maximum call stack size exceeded');
      }
      return stringify(value, ...(rest as [undefined]));
    }) as typeof JSON.stringify);
    try {
      const reply = await chat(h.url, 'r', poison);
      expect(reply.status).toBe(500);
      expect(reply.body).toMatchObject({ error: { code: 'internal_error' } });
    } finally {
      spy.mockRestore();
    }
    const status = await fetch(`${h.url}/ng-control/v1/checkpoint/status`, {
      headers: { authorization: 'Bearer tok' },
    });
    expect(await status.json()).toMatchObject({ report: { counts: { inflight: 0, held: 0 } } });
    const retired = await control(h.url, 'retire', {
      checkpoint_id: 'c0',
      deadline_ts: deadline(),
      episode_ids: episodes('r'),
    });
    expect(retired.status).toBe(200);
  });

  it('a call whose backend is unreachable, or whose client leaves while its answer is held, releases its ticket', async () => {
    const counts = async (url: string) => {
      const status = await fetch(`${url}/ng-control/v1/checkpoint/status`, {
        headers: { authorization: 'Bearer tok' },
      });
      return ((await status.json()) as { report: { counts: object } }).report.counts;
    };
    const retire = (url: string) =>
      control(url, 'retire', {
        checkpoint_id: 'c0',
        deadline_ts: deadline(),
        episode_ids: episodes('r'),
      });

    // Port 1 on loopback refuses the connection: the backend fails after admission.
    const down = await startHarness({ backendUrl: 'http://127.0.0.1:1/v1' });
    expect((await chat(down.url, 'r')).status).toBe(502);
    expect(await counts(down.url)).toMatchObject({ inflight: 0, held: 0 });
    expect((await retire(down.url)).status).toBe(200);

    const h = await startHarness();
    await fakeCtl(h.fake, 'hold', { after_calls: 0 });
    const client = new AbortController();
    const call = fetch(`${h.url}/ng-rollout/r/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify(CHAT_BODY),
      signal: client.signal,
    }).catch((err: unknown) => err);
    await until(async () => (await fakeCalls(h.fake)).length === 1, 'the backend to see the call');
    await control(h.url, 'prepare', { checkpoint_id: 'c1', deadline_ts: deadline() });
    await fakeCtl(h.fake, 'release');
    await until(async () => (await fakeCalls(h.fake))[0]?.returned === true, 'the answer');
    expect(await counts(h.url)).toMatchObject({ inflight: 1, held: 1 });
    client.abort();
    await call;
    await until(() => h.server.gate.inflight === 0, 'the held call to leave');
    expect(await counts(h.url)).toMatchObject({ inflight: 0, held: 0 });
    await control(h.url, 'resume', { checkpoint_id: 'c1', deadline_ts: deadline() });
    expect((await retire(h.url)).status).toBe(200);
  });

  it('untagged calls neither break a retire nor surface as untyped errors', async () => {
    const h = await startHarness();
    await fakeCtl(h.fake, 'hold', { after_calls: 0 });
    const untagged = chat(h.url, undefined);
    await until(async () => (await fakeCalls(h.fake)).length === 1, 'the backend to see the call');
    const retired = await control(h.url, 'retire', {
      checkpoint_id: 'c0',
      deadline_ts: deadline(),
      episode_ids: episodes('r'),
    });
    expect(retired.status).toBe(200);
    await fakeCtl(h.fake, 'release');
    expect((await untagged).status).toBe(200);
  });
});
