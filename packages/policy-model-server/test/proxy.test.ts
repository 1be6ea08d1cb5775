import { createServer, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { gzipSync } from 'node:zlib';

import { afterEach, describe, expect, it } from '@jest/globals';
import {
  captureKey,
  episodeId,
  MAX_ATTEMPT,
  MAX_CAPTURE_KEY_LENGTH,
  MAX_ROLLOUT_ID_LENGTH,
} from '@ckpt-gym/core/protocol';
import { deadline, episodes, tcpKeepAliveTimerOn, until } from '@ckpt-gym/testing';
import OpenAI from 'openai';

import { CAPTURE_CONTROL_PREFIX } from '../src/index.js';
import { BackendClient } from '../src/proxy.js';
import { CHAT_BODY, chat, cleanup, control, fakeCalls, startHarness, TOKEN } from './support.js';

afterEach(cleanup);

function client(url: string, key?: string): OpenAI {
  const prefix = key === undefined ? '' : `/ng-rollout/${key}`;
  return new OpenAI({ baseURL: `${url}${prefix}/v1`, apiKey: 'unused', maxRetries: 0 });
}

describe('the proxy with the official openai client', () => {
  it('answers chat completions, plain and streamed, through the backend', async () => {
    const h = await startHarness({ checkpoint: false });
    const openai = client(h.url, 'r');
    const reply = await openai.chat.completions.create({
      model: 'fake-model',
      messages: [{ role: 'user', content: 'weather?' }],
    });
    expect(reply.choices[0]?.message.tool_calls?.[0]).toMatchObject({
      type: 'function',
      function: { name: 'get_weather' },
    });
    const stream = await openai.chat.completions.create({
      model: 'fake-model',
      stream: true,
      messages: [{ role: 'user', content: 'weather?' }],
    });
    let args = '';
    for await (const chunk of stream) {
      args += chunk.choices[0]?.delta.tool_calls?.[0]?.function?.arguments ?? '';
    }
    expect(JSON.parse(args)).toEqual({ city: 'SF' });
  });

  it('passes the rollout prefix on to the backend, and untagged calls stay untagged', async () => {
    const h = await startHarness({ checkpoint: false });
    await client(h.url, 'r-a2').chat.completions.create(CHAT_BODY as never);
    await client(h.url).chat.completions.create(CHAT_BODY as never);
    const calls = await fakeCalls(h.fake);
    expect(calls.map((c) => c.capture_key)).toEqual(['r-a2', null]);
  });

  it('runs a Responses tool turn: function_call out, function_call_output back in, text out', async () => {
    const h = await startHarness({ checkpoint: false });
    const openai = client(h.url, 'r');
    const tools = [
      {
        type: 'function' as const,
        name: 'get_weather',
        parameters: { type: 'object', properties: { city: { type: 'string' } } },
        strict: false,
      },
    ];
    const first = await openai.responses.create({ model: 'fake-model', input: 'weather?', tools });
    const call = first.output.find((item) => item.type === 'function_call');
    expect(call).toMatchObject({ name: 'get_weather', arguments: '{"city":"SF"}' });
    if (call?.type !== 'function_call') throw new Error('no function call');
    const second = await openai.responses.create({
      model: 'fake-model',
      tools,
      input: [
        { role: 'user', content: 'weather?' },
        {
          type: 'function_call',
          call_id: call.call_id,
          name: call.name,
          arguments: call.arguments,
        },
        { type: 'function_call_output', call_id: call.call_id, output: '{"temp": 20}' },
      ],
    });
    expect(second.output_text).toBe('The weather in SF is sunny.');
    expect(second.status).toBe('completed');
    expect(second.usage?.output_tokens).toBeGreaterThan(0);
  });

  it('streams a Responses answer as Responses events', async () => {
    const h = await startHarness({ checkpoint: false });
    const openai = client(h.url, 'r');
    const stream = await openai.responses.create({
      model: 'fake-model',
      stream: true,
      input: [
        { role: 'user', content: 'weather?' },
        { type: 'function_call', call_id: 'c1', name: 'get_weather', arguments: '{}' },
        { type: 'function_call_output', call_id: 'c1', output: 'sunny' },
      ],
    });
    const types: string[] = [];
    let text = '';
    let completed: unknown;
    for await (const event of stream) {
      types.push(event.type);
      if (event.type === 'response.output_text.delta') text += event.delta;
      if (event.type === 'response.completed') completed = event.response;
    }
    expect(types[0]).toBe('response.created');
    expect(types.at(-1)).toBe('response.completed');
    expect(text).toBe('The weather in SF is sunny.');
    expect(completed).toMatchObject({ status: 'completed', output: [{ type: 'message' }] });
  });

  it('serves GET /v1/models from the backend and GET /health itself', async () => {
    const h = await startHarness({ checkpoint: false });
    const models = await client(h.url).models.list();
    expect(models.data.map((m) => m.id)).toEqual(['fake-model']);
    const health = await (await fetch(`${h.url}/health`)).json();
    expect(health).toMatchObject({ status: 'ok', kind: 'model' });
  });
});

describe('identity prefixes', () => {
  it('a malformed identity prefix is 400 invalid_rollout_id and never reaches the backend', async () => {
    const h = await startHarness();
    for (const key of ['bad!id', '-a1']) {
      const reply = await chat(h.url, key);
      expect(reply.status).toBe(400);
      expect(reply.body).toMatchObject({ error: { code: 'invalid_rollout_id' } });
    }
    expect(await fakeCalls(h.fake)).toEqual([]);
  });

  it('a stale identity prefix is 409 stale_attempt with x-should-retry: false and never reaches the backend', async () => {
    const h = await startHarness();
    const retired = await control(h.url, 'retire', {
      checkpoint_id: 'c0',
      deadline_ts: deadline(),
      episode_ids: episodes('r-a1'),
    });
    expect(retired.status).toBe(200);
    for (const key of ['r', 'r-a1']) {
      const reply = await chat(h.url, key);
      expect(reply.status).toBe(409);
      expect(reply.body).toMatchObject({ error: { code: 'stale_attempt' } });
      expect(reply.headers.get('x-should-retry')).toBe('false');
    }
    expect((await chat(h.url, 'r-a2')).status).toBe(200);
    expect((await fakeCalls(h.fake)).map((c) => c.capture_key)).toEqual(['r-a2']);
  });
});

describe('request bodies', () => {
  it('a body in another charset, with a broken content encoding or nested 10k levels deep is 422 invalid_request and never reaches the backend', async () => {
    const h = await startHarness();
    const routes = [
      '/ng-rollout/r/v1/chat/completions',
      '/ng-rollout/r/v1/responses',
      `${CAPTURE_CONTROL_PREFIX}/rollouts/retire`,
    ];
    const body = JSON.stringify(CHAT_BODY);
    const deep = `${body.slice(0, -1)},"input":"weather?","tools":${'['.repeat(10_000)}${']'.repeat(10_000)}}`;
    const cases: [Record<string, string>, string | Uint8Array, string][] = [
      [{ 'content-type': 'application/json; charset=latin1' }, body, 'charset must be utf-8'],
      [{ 'content-encoding': 'gzip' }, gzipSync(body).subarray(0, 12), 'could not be decompressed'],
      [{}, deep, 'nests deeper than'],
    ];
    for (const route of routes) {
      for (const [headers, sent, detail] of cases) {
        const res = await fetch(`${h.url}${route}`, {
          method: 'POST',
          headers: {
            'content-type': 'application/json',
            authorization: `Bearer ${TOKEN}`,
            ...headers,
          },
          body: sent,
        });
        expect([route, headers, res.status, await res.json()]).toEqual([
          route,
          headers,
          422,
          { error: { code: 'invalid_request', detail: expect.stringContaining(detail) } },
        ]);
      }
    }
    expect(await fakeCalls(h.fake)).toEqual([]);
  });
});

describe('client mistakes are refused before the call is admitted', () => {
  it('a chat message whose tool call has no string name and arguments is 422 invalid_request', async () => {
    const h = await startHarness();
    for (const call of [{ function: { name: 'f' } }, { function: 'f' }, null]) {
      const reply = await chat(h.url, 'r', {
        model: 'fake-model',
        messages: [
          { role: 'user', content: 'weather?' },
          { role: 'assistant', content: null, tool_calls: [call] },
        ],
      });
      expect(reply).toMatchObject({
        status: 422,
        body: {
          error: { code: 'invalid_request', detail: expect.stringContaining('tool_calls[0]') },
        },
      });
    }
    expect(await fakeCalls(h.fake)).toEqual([]);
  });

  it.each([
    ['with token capture', {}],
    ['without token capture', { capture: false }],
  ])(
    "a rollout id longer than core's MAX_ROLLOUT_ID_LENGTH is 400 invalid_rollout_id, the longest is served (%s)",
    async (_name, options) => {
      const h = await startHarness(options);
      const longest = 'r'.repeat(MAX_ROLLOUT_ID_LENGTH);
      // 255 characters once passed and made every call a 500 naming a file (ENAMETOOLONG).
      for (const key of [`${longest}r`, `${longest}r-a1`, 'r'.repeat(255), 'r'.repeat(10_000)]) {
        const reply = await chat(h.url, key);
        expect([key.length, reply.status, reply.body]).toEqual([
          key.length,
          400,
          { error: expect.objectContaining({ code: 'invalid_rollout_id' }) },
        ]);
      }
      expect(await fakeCalls(h.fake)).toEqual([]);
      // The longest capture key names its ledger file (capture on) and is served.
      const key = captureKey(episodeId(longest, MAX_ATTEMPT));
      expect(key.length).toBeLessThanOrEqual(MAX_CAPTURE_KEY_LENGTH);
      expect((await chat(h.url, key)).status).toBe(200);
    },
  );
});

const onLinux = process.platform === 'linux' ? it : it.skip;

describe('backend connections', () => {
  onLinux('a held call to a loopback backend sends no TCP keep-alive probes', async () => {
    const held: ServerResponse[] = [];
    const backend = createServer((_req, res) => held.push(res)).listen(0, '127.0.0.1');
    await new Promise((resolve) => backend.once('listening', resolve));
    const client = new BackendClient();
    try {
      const url = `http://127.0.0.1:${(backend.address() as AddressInfo).port}/v1/chat/completions`;
      const signal = new AbortController().signal;
      const reply = client.request(url, { method: 'POST', headers: {}, body: '{}', signal });
      await until(() => held.length === 1);
      const socket = held[0]!.socket!;
      expect(tcpKeepAliveTimerOn(socket.remotePort!, socket.localPort!)).toBe(false);
      held[0]!.end('{}');
      (await reply).resume();
    } finally {
      client.close();
      backend.closeAllConnections();
      backend.close();
    }
  });
});
