/**
 * Every data-plane route of the policy model server answers a malformed request as the client's
 * mistake: below 500, in the standard JSON error shape (issue 24 item 9). The backend is the fake
 * inference server on loopback.
 */
import { afterAll, afterEach, describe, expect, test } from '@jest/globals';
import fc from 'fast-check';

import {
  closeConnections,
  expectClientOutcome,
  fuzzParameters,
  malformedRequest,
  send,
} from '@ckpt-gym/testing';
import { cleanup, post, startHarness, TOKEN } from './support.js';

afterEach(cleanup);
afterAll(closeConnections);

/** A first turn: the fake backend answers it with a `get_weather {"city":"SF"}` call. */
const FIRST_TURN = {
  chat: {
    model: 'fake-model',
    messages: [
      { role: 'system', content: 'be brief' },
      { role: 'user', content: [{ type: 'text', text: 'weather?' }] },
    ],
  },
  responses: {
    model: 'fake-model',
    instructions: 'be brief',
    input: [{ type: 'message', role: 'user', content: [{ type: 'input_text', text: 'weather?' }] }],
  },
};

/** The second turns, which send that answer back: with capture on they continue the first call. */
const CHAT = {
  ...FIRST_TURN.chat,
  messages: [
    ...FIRST_TURN.chat.messages,
    {
      role: 'assistant',
      content: null,
      tool_calls: [
        {
          id: 'c1',
          type: 'function',
          function: { name: 'get_weather', arguments: '{"city":"SF"}' },
        },
      ],
    },
    { role: 'tool', tool_call_id: 'c1', content: 'sunny' },
  ],
  tools: [{ type: 'function', function: { name: 'get_weather', parameters: {} } }],
  stream: false,
  stream_options: { include_usage: true },
};

const RESPONSES = {
  ...FIRST_TURN.responses,
  input: [
    ...FIRST_TURN.responses.input,
    { type: 'reasoning', summary: [{ type: 'summary_text', text: 'think' }] },
    { type: 'function_call', call_id: 'c1', name: 'get_weather', arguments: '{"city":"SF"}' },
    { type: 'function_call_output', call_id: 'c1', output: 'sunny' },
  ],
  tools: [{ type: 'function', name: 'get_weather', parameters: { type: 'object' }, strict: true }],
  tool_choice: 'auto',
  reasoning: { effort: 'low' },
  max_output_tokens: 64,
  stream: false,
};

const KEYS = ['r1', 'r1-a2'];

/** The prefix forms every generation route is reached under, and prefixes naming no episode. */
const PREFIXES = fc.oneof(
  { arbitrary: fc.constantFrom('', ...KEYS.map((key) => `/ng-rollout/${key}`)), weight: 6 },
  fc.constantFrom(
    `/ng-rollout/${'r'.repeat(300)}`,
    '/ng-rollout/',
    '/ng-rollout/%ZZ',
    '/ng-rollout/%ED%A0%80',
    '/ng-rollout/a%2Fb',
    '/ng-rollout/r-a0x',
    '/ng-rollout/r-a99999999999999999999',
  ),
);

describe.each([
  ['checkpointing and capture off', { checkpoint: false, capture: false }],
  ['checkpointing and capture on', { checkpoint: true, capture: true }],
])('with %s', (_name, stack) => {
  test.each([
    ['/v1/chat/completions', 'chat', CHAT],
    ['/v1/chat/completions', 'chat', { ...CHAT, stream: true }],
    ['/v1/responses', 'responses', RESPONSES],
    ['/v1/responses', 'responses', { ...RESPONSES, stream: true }],
  ] as const)(
    '%s answers malformed bodies with client errors (%s %#)',
    async (route, kind, valid) => {
      const h = await startHarness(stack);
      for (const key of KEYS) {
        const first = await post(`${h.url}/ng-rollout/${key}${route}`, FIRST_TURN[kind]);
        expect(first.status).toBe(200);
      }
      await fc.assert(
        fc.asyncProperty(PREFIXES, malformedRequest(valid), async (prefix, raw) => {
          expectClientOutcome(raw, await send(`${h.url}${prefix}${route}`, raw));
        }),
        fuzzParameters(150),
      );
      if (h.server.ledger) {
        // The fuzz ran through parent resolution: valid second turns continued the first call.
        const rows = await h.server.ledger.exportRows('r1');
        expect(rows.some((row) => row.parent_call_id !== null)).toBe(true);
      }
    },
  );
});

test('/v1/models answers any prefix, query and body with a model list or a client error', async () => {
  const h = await startHarness();
  const query = fc.constantFrom('', '?', '?x=%ZZ', '?a=1&a=2', `?q=${'x'.repeat(4000)}`, '#f');
  await fc.assert(
    fc.asyncProperty(PREFIXES, query, malformedRequest({}), async (prefix, q, raw) => {
      const reply = await send(`${h.url}${prefix}/v1/models${q}`, raw, { method: 'GET' });
      expectClientOutcome(raw, reply);
      if (reply.status === 200) expect(JSON.parse(reply.text)).toMatchObject({ object: 'list' });
    }),
    fuzzParameters(100),
  );
});

test('the capture ledger manifest answers ids naming no ledger with client errors', async () => {
  const h = await startHarness();
  const ids = fc.oneof(
    fc.constantFrom('r'.repeat(300), '%ZZ', '%ED%A0%80', 'a%2Fb', '..', '%2E%2E', 'r-a0', ' '),
    fc
      .string({ unit: 'binary', maxLength: 20 })
      .map((id) => encodeURIComponent(id.replace(/[\ud800-\udfff]/g, ''))),
  );
  await fc.assert(
    fc.asyncProperty(ids, async (id) => {
      const reply = await send(
        `${h.url}/training-token-capture/control/rollouts/${id}/manifest`,
        null,
        {
          method: 'GET',
          headers: { authorization: `Bearer ${TOKEN}` },
        },
      );
      expectClientOutcome(null, reply);
    }),
    fuzzParameters(150),
  );
});

test.each(['retire', 'delete'])(
  'the capture ledger /rollouts/%s answers malformed bodies with client errors',
  async (op) => {
    const h = await startHarness();
    const url = `${h.url}/training-token-capture/control/rollouts/${op}`;
    await fc.assert(
      fc.asyncProperty(malformedRequest({ rollout_ids: ['r1', 'r2-a1'] }), async (raw) => {
        expectClientOutcome(
          raw,
          await send(url, raw, { headers: { authorization: `Bearer ${TOKEN}` } }),
        );
      }),
      fuzzParameters(250),
    );
  },
);
