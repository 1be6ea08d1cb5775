import { connect } from 'node:net';
import { gzipSync } from 'node:zlib';

import { LAUNCH_ID_ENV } from '@ckpt-gym/core/server';
import { until } from '@ckpt-gym/testing';

import { DEFAULT_SERVER_NAME, type RunningFakeInference, startFakeInference } from '../src/app.js';
import type { CallView } from '../src/calls.js';
import { SCRIPTS } from '../src/script.js';

let fake: RunningFakeInference;

beforeEach(async () => {
  fake = await startFakeInference();
});

afterEach(async () => {
  await fake.close();
});

const USER = { role: 'user', content: 'What is the weather in SF?' };

function chatPath(captureKey?: string): string {
  return `${captureKey === undefined ? '' : `/ng-rollout/${captureKey}`}/v1/chat/completions`;
}

async function post(path: string, body?: unknown, signal?: AbortSignal): Promise<Response> {
  return fetch(`${fake.url}${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    ...(body === undefined ? {} : { body: JSON.stringify(body) }),
    ...(signal ? { signal } : {}),
  });
}

async function getJson(path: string): Promise<unknown> {
  const res = await fetch(`${fake.url}${path}`);
  expect(res.status).toBe(200);
  return res.json();
}

async function control(path: string, body?: unknown): Promise<Record<string, unknown>> {
  const res = await post(`/_ctl/${path}`, body);
  expect(res.status).toBe(200);
  return (await res.json()) as Record<string, unknown>;
}

interface Completion {
  choices: {
    message: {
      content: string | null;
      tool_calls?: { id: string; function: { name: string; arguments: string } }[];
    };
    finish_reason: string;
  }[];
  usage: { prompt_tokens: number; completion_tokens: number; total_tokens: number };
}

async function chat(
  messages: unknown[],
  captureKey?: string,
  extra: object = {},
): Promise<Completion> {
  const res = await post(chatPath(captureKey), { model: 'fake-model', messages, ...extra });
  expect(res.status).toBe(200);
  return (await res.json()) as Completion;
}

async function calls(): Promise<CallView[]> {
  return ((await getJson('/_ctl/calls')) as { calls: CallView[] }).calls;
}

/** The first value `read` gives that passes `check`; the fake answers between polls. */
async function eventually<T>(read: () => Promise<T>, check: (value: T) => boolean): Promise<T> {
  let value!: T;
  await until(async () => check((value = await read())), 'the fake backend to get there');
  return value;
}

const callCount = async () => ((await getJson('/_ctl/call_count')) as { count: number }).count;
const untilCalls = (n: number) => eventually(callCount, (c) => c >= n);

/** The conversation after the agent ran the tool calls of `reply`. */
function withToolResults(messages: unknown[], reply: Completion, result = 'ok'): unknown[] {
  const message = reply.choices[0]!.message;
  return [
    ...messages,
    message,
    ...(message.tool_calls ?? []).map((c) => ({
      role: 'tool',
      tool_call_id: c.id,
      content: result,
    })),
  ];
}

describe('scripted turns', () => {
  test('default weather script: a get_weather tool call, then the final answer', async () => {
    const first = await chat([USER], 'w');
    expect(first.choices[0]).toMatchObject({
      finish_reason: 'tool_calls',
      message: {
        content: null,
        tool_calls: [
          { type: 'function', function: { name: 'get_weather', arguments: '{"city":"SF"}' } },
        ],
      },
    });
    const second = await chat(withToolResults([USER], first, 'sunny'), 'w');
    expect(second.choices[0]).toMatchObject({
      finish_reason: 'stop',
      message: { content: 'The weather in SF is sunny.' },
    });
  });

  test('the turn comes from the history: a restored attempt re-sending it gets the next turn', async () => {
    const first = await chat([USER], 'w');
    const resent = await chat(withToolResults([USER], first), 'w-a1');
    expect(resent.choices[0]?.finish_reason).toBe('stop');
    const fresh = await chat([USER], 'w-a2');
    expect(fresh.choices[0]?.finish_reason).toBe('tool_calls');
  });

  test('counter script: count 1, count 2, then the final answer', async () => {
    await control('script', { script: 'counter' });
    let messages: unknown[] = [USER];
    const seen: string[] = [];
    for (;;) {
      const reply = await chat(messages, 'c');
      const choice = reply.choices[0]!;
      if (choice.finish_reason === 'stop') {
        seen.push(choice.message.content ?? '');
        break;
      }
      seen.push(choice.message.tool_calls?.[0]?.function.arguments ?? '');
      messages = withToolResults(messages, reply);
    }
    expect(seen).toEqual(['{"count":1}', '{"count":2}', SCRIPTS.counter.final_answer]);
  });

  test('a per-rollout script applies to that rollout only; a capture key to that attempt only', async () => {
    expect(await control('script', { script: 'counter', rollout: 'c' })).toEqual({
      ok: true,
      rollout: 'c',
    });
    await control('script', { script: [{ content: 'attempt two says hi' }], rollout: 'c-a2' });
    const name = (r: Completion) =>
      r.choices[0]?.message.tool_calls?.[0]?.function.name ?? r.choices[0]?.message.content;
    expect(name(await chat([USER], 'c-a1'))).toBe('increment_counter');
    expect(name(await chat([USER], 'c-a2'))).toBe('attempt two says hi');
    expect(name(await chat([USER], 'w'))).toBe('get_weather');
    expect(name(await chat([USER]))).toBe('get_weather');
  });

  test('usage counts the deterministic tokens the call log shows', async () => {
    const a = await chat([USER], 'u');
    const b = await chat([USER], 'u');
    expect(a.usage).toEqual(b.usage);
    expect(a.usage.prompt_tokens).toBeGreaterThan(0);
    expect(a.usage.total_tokens).toBe(a.usage.prompt_tokens + a.usage.completion_tokens);
    const [record] = await calls();
    expect(record).toMatchObject({
      prompt_tokens: a.usage.prompt_tokens,
      completion_tokens: a.usage.completion_tokens,
    });
  });
});

interface ToolDelta {
  index: number;
  id?: string;
  function?: { name?: string; arguments?: string };
}

interface Chunk {
  object: string;
  choices: {
    delta: { content?: string | null; tool_calls?: ToolDelta[] };
    finish_reason: string | null;
  }[];
  usage?: unknown;
}

describe('streaming', () => {
  async function streamed(messages: unknown[], extra: object = {}) {
    const res = await post(chatPath('s'), { messages, stream: true, ...extra });
    expect(res.status).toBe(200);
    expect(res.headers.get('content-type')).toMatch(/^text\/event-stream/);
    const text = await res.text();
    const data = text
      .split('\n\n')
      .filter((event) => event.startsWith('data: '))
      .map((event) => event.slice('data: '.length));
    expect(data.at(-1)).toBe('[DONE]');
    const chunks = data.slice(0, -1).map((d) => JSON.parse(d) as Chunk);
    return { text, chunks };
  }

  test('a final answer arrives as several content chunks, then finish_reason stop, then [DONE]', async () => {
    const { chunks } = await streamed([
      USER,
      { role: 'assistant', content: null },
      { role: 'tool', content: 'sunny' },
    ]);
    const deltas = chunks.map((c) => c.choices[0]?.delta);
    const content = deltas.map((d) => d?.content ?? '').join('');
    expect(content).toBe('The weather in SF is sunny.');
    expect(deltas.filter((d) => d?.content).length).toBeGreaterThan(2);
    expect(chunks.every((c) => c.object === 'chat.completion.chunk')).toBe(true);
    expect(chunks.at(-1)?.choices[0]?.finish_reason).toBe('stop');
  });

  test('a tool call streams its id and name first, then its arguments in pieces', async () => {
    const { chunks } = await streamed([USER]);
    const toolDeltas = chunks.flatMap((c) => c.choices[0]?.delta.tool_calls ?? []);
    expect(toolDeltas[0]).toMatchObject({
      index: 0,
      id: 'call_0_0',
      function: { name: 'get_weather' },
    });
    expect(toolDeltas.length).toBeGreaterThan(2);
    expect(toolDeltas.map((d) => d.function?.arguments ?? '').join('')).toBe('{"city":"SF"}');
    expect(chunks.at(-1)?.choices[0]?.finish_reason).toBe('tool_calls');
  });

  test('stream_options.include_usage adds a last chunk with usage and no choices', async () => {
    const { chunks } = await streamed([USER], { stream_options: { include_usage: true } });
    expect(chunks.at(-1)).toMatchObject({
      choices: [],
      usage: { prompt_tokens: expect.any(Number) },
    });
  });

  test('a held streamed call sends keep-alive comments until it is released', async () => {
    await control('keepalive', { interval_ms: 20 });
    await control('hold', { after_calls: 0 });
    // fetch resolves only once the headers came, which here only a keep-alive comment sends.
    const res = await post(chatPath('k'), { messages: [USER], stream: true });
    expect(res.status).toBe(200);
    await control('release');
    const text = await res.text();
    expect(text.startsWith(': keep-alive\n\n')).toBe(true);
    expect(text.endsWith('data: [DONE]\n\n')).toBe(true);
  });
});

describe('call log', () => {
  test('records capture key, rollout, attempt, message count, admission and stream; untagged calls are null', async () => {
    await chat([USER, USER], 'r-a2', { ng_capture: { model_call_id: 'm1' }, ng_other: 1 });
    await post(chatPath(), { messages: [USER], stream: true }).then((r) => r.text());
    const log = await eventually(calls, (c) => c.length === 2 && c.every((x) => x.returned));
    expect(log).toEqual([
      expect.objectContaining({
        index: 0,
        capture_key: 'r-a2',
        rollout_id: 'r',
        attempt: 2,
        n_messages: 2,
        admission: { model_call_id: 'm1' },
        stream: false,
        held: false,
        returned: true,
        dropped: false,
        continued_from: null,
        reused_prefix_tokens: 0,
      }),
      expect.objectContaining({
        index: 1,
        capture_key: null,
        rollout_id: null,
        attempt: null,
        admission: null,
        stream: true,
      }),
    ]);
  });

  test('call_count counts every call, and the calls waiting now', async () => {
    expect(await getJson('/_ctl/call_count')).toEqual({ count: 0, waiting: 0 });
    await chat([USER], 'a');
    await chat([USER]);
    expect(await getJson('/_ctl/call_count')).toEqual({ count: 2, waiting: 0 });
    await control('hold', { after_calls: 2 });
    const held = chat([USER], 'b');
    await untilCalls(3);
    expect(await getJson('/_ctl/call_count')).toEqual({ count: 3, waiting: 1 });
    await control('release');
    await held;
    expect(await getJson('/_ctl/call_count')).toEqual({ count: 3, waiting: 0 });
  });

  test('cuts come from the token store: empty until a cut round is recorded', async () => {
    expect(await getJson('/_ctl/cuts')).toEqual({ cuts: [] });
    fake.state.tokens.recordCutRound(['m1']);
    expect(await getJson('/_ctl/cuts')).toEqual({ cuts: [['m1']] });
  });
});

describe('holds and the gate', () => {
  test('after_calls holds every call from global index n on, whatever its rollout', async () => {
    expect(await control('hold', { after_calls: 1 })).toEqual({
      ok: true,
      hold: { after_calls: 1, after_calls_per_rollout: null, after_tokens: 0 },
    });
    await chat([USER], 'a');
    const held = [chat([USER], 'b'), chat([USER])];
    const log = await eventually(calls, (c) => c.length === 3);
    expect(log.map((c) => [c.held, c.returned])).toEqual([
      [false, true],
      [true, false],
      [true, false],
    ]);
    expect(await control('release')).toEqual({ ok: true, released: 2 });
    await Promise.all(held);
    await chat([USER], 'c');
    expect((await calls())[3]?.held).toBe(false);
  });

  test('after_calls_per_rollout holds a rollout after its first n calls, over its attempts; others pass', async () => {
    await control('hold', { after_calls_per_rollout: 1 });
    await chat([USER], 'a');
    await chat([USER], 'b');
    const heldA = chat([USER], 'a');
    const heldRetry = chat([USER], 'a-a1');
    await untilCalls(4);
    await chat([USER], 'c');
    await chat([USER]);
    await chat([USER]);
    const log = await calls();
    expect(log.map((c) => `${c.capture_key}:${c.held}`)).toEqual([
      'a:false',
      'b:false',
      'a:true',
      'a-a1:true',
      'c:false',
      'null:false',
      'null:false',
    ]);
    expect(await control('step', { calls: 2 })).toEqual({ ok: true, released: 2, waiting: 0 });
    await Promise.all([heldA, heldRetry]);
  });

  test('a closed gate makes new calls wait; step releases the n oldest; opening releases the rest', async () => {
    expect(await control('gate', {})).toEqual({ ok: true, closed: true, released: 0 });
    const replies: Promise<Completion>[] = [];
    const done: string[] = [];
    for (const key of ['g0', 'g1', 'g2']) {
      replies.push(chat([USER], key).then((r) => (done.push(key), r)));
      await untilCalls(replies.length);
    }
    expect(await control('step', { calls: 2 })).toEqual({ ok: true, released: 2, waiting: 1 });
    await Promise.all(replies.slice(0, 2));
    expect(done.sort()).toEqual(['g0', 'g1']);
    expect((await calls()).map((c) => c.returned)).toEqual([true, true, false]);
    expect(await control('gate', { closed: false })).toEqual({
      ok: true,
      closed: false,
      released: 1,
    });
    await replies[2];
    await chat([USER], 'g3');
  });

  test('release clears the hold and opens the gate', async () => {
    await control('hold', { after_calls: 0 });
    await control('gate');
    const held = chat([USER], 'x');
    await untilCalls(1);
    expect(await control('release')).toEqual({ ok: true, released: 1 });
    await held;
    await chat([USER], 'y');
    expect((await calls()).map((c) => c.held)).toEqual([true, false]);
  });

  test('a held call whose client disconnects is dropped: never returned, and step skips it', async () => {
    await control('hold', { after_calls: 0 });
    const client = new AbortController();
    const gone = post(chatPath('d'), { messages: [USER] }, client.signal).catch(
      (err: unknown) => err,
    );
    await untilCalls(1);
    client.abort();
    await gone;
    const [record] = await eventually(calls, (c) => c[0]?.dropped === true);
    expect(record).toMatchObject({ held: true, returned: false, dropped: true });
    expect(await control('step', { calls: 1 })).toEqual({ ok: true, released: 0, waiting: 0 });
  });
});

describe('models, errors and routes', () => {
  test("GET /health names the backend and its process, as the gym servers' /health does", async () => {
    expect(await getJson('/health')).toEqual({
      status: 'ok',
      name: DEFAULT_SERVER_NAME,
      kind: 'inference',
      pid: process.pid,
      launch_id: null,
    });
    process.env[LAUNCH_ID_ENV] = 'launch-7';
    const named = await startFakeInference({ name: 'inference' });
    try {
      expect(await (await fetch(`${named.url}/health`)).json()).toEqual({
        status: 'ok',
        name: 'inference',
        kind: 'inference',
        pid: process.pid,
        launch_id: 'launch-7',
      });
    } finally {
      delete process.env[LAUNCH_ID_ENV];
      await named.close();
    }
  });

  test('GET /v1/models lists the model, with or without a rollout prefix', async () => {
    const expected = {
      object: 'list',
      data: [expect.objectContaining({ id: 'fake-model', object: 'model' })],
    };
    expect(await getJson('/v1/models')).toEqual(expected);
    expect(await getJson('/ng-rollout/r/v1/models')).toEqual(expected);
  });

  test('a malformed rollout prefix is 400 invalid_rollout_id and is not recorded', async () => {
    const res = await post(chatPath('x-a1-a2'), { messages: [USER] });
    expect(res.status).toBe(400);
    expect(((await res.json()) as { error: { code: string } }).error.code).toBe(
      'invalid_rollout_id',
    );
    expect(await callCount()).toBe(0);
  });

  test.each([
    ['/v1/chat/completions', { messages: [] }],
    ['/v1/chat/completions', { messages: [{ content: 'no role' }] }],
    ['/v1/chat/completions', { messages: [USER], stream: 'yes' }],
    [
      '/v1/chat/completions',
      { messages: [{ role: 'assistant', tool_calls: [{ function: { name: { toString: 1 } } }] }] },
    ],
    ['/v1/chat/completions', { messages: [{ role: 'assistant', tool_calls: [null] }] }],
    ['/v1/chat/completions', { messages: [{ role: 'assistant', tool_calls: 'f' }] }],
    ['/_ctl/hold', {}],
    ['/_ctl/hold', { after_calls: -1 }],
    ['/_ctl/step', { calls: 'two' }],
    ['/_ctl/gate', { closed: 1 }],
    ['/_ctl/release', { everything: true }],
    ['/_ctl/keepalive', { interval_ms: 1.5 }],
    ['/_ctl/script', { script: 'sunny' }],
    ['/_ctl/script', { script: 'counter', rollout: 'x-a1-a2' }],
    ['/_ctl/script', { script: 'counter', rollout: 7 }],
    ['/_ctl/script', { script: 'counter', extra: 1 }],
  ])('POST %s %j is 422 invalid_request', async (path, body) => {
    const res = await post(path, body);
    expect(res.status).toBe(422);
    expect(((await res.json()) as { error: { code: string } }).error.code).toBe('invalid_request');
  });

  test('a body that is not JSON is 422 invalid_request', async () => {
    const res = await fetch(`${fake.url}/_ctl/hold`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: '{after_calls',
    });
    expect(res.status).toBe(422);
  });

  test('a body in another charset, with a broken content encoding or nested 10k levels deep is 422 invalid_request', async () => {
    const body = JSON.stringify({ model: 'fake-model', messages: [USER] });
    const cases: [Record<string, string>, string | Uint8Array, string][] = [
      [{ 'content-type': 'application/json; charset=latin1' }, body, 'charset must be utf-8'],
      [{ 'content-encoding': 'gzip' }, gzipSync(body).subarray(0, 12), 'could not be decompressed'],
      [{ 'content-encoding': 'deflate' }, body, 'could not be decompressed'],
      [
        {},
        `{"model":"m","messages":${'['.repeat(10_000)}${']'.repeat(10_000)}}`,
        'nests deeper than',
      ],
    ];
    for (const [headers, sent, detail] of cases) {
      const res = await fetch(`${fake.url}${chatPath('r1')}`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', ...headers },
        body: sent,
      });
      expect([headers, res.status, await res.json()]).toEqual([
        headers,
        422,
        { error: { code: 'invalid_request', detail: expect.stringContaining(detail) } },
      ]);
    }
    expect(await calls()).toEqual([]);
  });

  test('too large request headers are a 431 in the JSON error shape', async () => {
    const reply = await new Promise<string>((resolve, reject) => {
      const socket = connect(fake.port, '127.0.0.1');
      const chunks: Buffer[] = [];
      socket.on('data', (chunk: Buffer) => chunks.push(chunk));
      socket.on('error', reject);
      socket.on('close', () => resolve(Buffer.concat(chunks).toString('utf8')));
      socket.write(`GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: ${'a'.repeat(100_000)}\r\n\r\n`);
    });
    const [head = '', body = ''] = reply.split('\r\n\r\n');
    expect(head.split('\r\n')[0]).toBe('HTTP/1.1 431 Request Header Fields Too Large');
    expect(head).toMatch(/^content-type: application\/json/m);
    expect(JSON.parse(body)).toEqual({
      error: { code: 'headers_too_large', detail: expect.stringContaining('request headers') },
    });
  });

  test('an unknown route is a JSON 404 not_found', async () => {
    const res = await fetch(`${fake.url}/v1/responses`, { method: 'POST' });
    expect(res.status).toBe(404);
    expect(await res.json()).toEqual({
      error: { code: 'not_found', detail: expect.stringContaining('/v1/responses') },
    });
  });
});

// The process-level test of `ckpt-gym-fake-inference` (spawn the built main.js, read its
// listening line, SIGTERM) belongs to the e2e suite, which builds the packages first; here the
// library entry `startFakeInference` that main.ts wraps is what every test above runs against.
