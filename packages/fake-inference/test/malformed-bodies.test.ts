/**
 * The fake inference backend's OpenAI routes answer a malformed request as the client's mistake:
 * below 500, in the standard JSON error shape (issue 24 item 9): chat completions plain and
 * streamed, with and without a capture admission (`ng_capture`), under the rollout prefix or not;
 * `/v1/models`.
 */
import { rootCaptureAdmission } from '@ckpt-gym/core/capture';
import fc from 'fast-check';

import { type RunningFakeInference, startFakeInference } from '../src/app.js';
import {
  closeConnections,
  expectClientOutcome,
  fuzzParameters,
  malformedRequest,
  send,
} from '@ckpt-gym/testing';

let fake: RunningFakeInference;
beforeEach(async () => {
  fake = await startFakeInference();
});
afterEach(() => fake.close());
afterAll(closeConnections);

const CHAT = {
  model: 'fake-model',
  messages: [
    { role: 'system', content: 'be brief' },
    { role: 'user', content: [{ type: 'text', text: 'What is the weather in SF?' }] },
    {
      role: 'assistant',
      content: null,
      tool_calls: [
        { id: 'c1', type: 'function', function: { name: 'get_weather', arguments: '{"a":1}' } },
      ],
    },
    { role: 'tool', tool_call_id: 'c1', content: 'sunny' },
  ],
  stream: false,
  stream_options: { include_usage: true },
};

/** A root call's capture admission, as the policy model server sends it. */
function admission(callId: number) {
  return rootCaptureAdmission('r1', `call-${callId}`);
}

const PREFIXES = fc.constantFrom('', '/ng-rollout/r1', '/ng-rollout/r1-a2', '/ng-rollout/%ZZ');

test.each([
  ['plain', CHAT],
  ['streamed', { ...CHAT, stream: true }],
])('/v1/chat/completions answers malformed %s bodies with client errors', async (_name, valid) => {
  await fc.assert(
    fc.asyncProperty(PREFIXES, malformedRequest(valid), async (prefix, raw) => {
      expectClientOutcome(raw, await send(`${fake.url}${prefix}/v1/chat/completions`, raw));
    }),
    fuzzParameters(200),
  );
});

test('/v1/chat/completions answers malformed capture admissions with client errors', async () => {
  await fc.assert(
    fc.asyncProperty(
      fc.nat().chain((n) => malformedRequest({ ...CHAT, ng_capture: admission(n) })),
      async (raw) => {
        expectClientOutcome(raw, await send(`${fake.url}/ng-rollout/r1/v1/chat/completions`, raw));
      },
    ),
    fuzzParameters(200),
  );
});

test('/v1/models answers any prefix and body with a model list or a client error', async () => {
  await fc.assert(
    fc.asyncProperty(PREFIXES, malformedRequest({}), async (prefix, raw) => {
      const reply = await send(`${fake.url}${prefix}/v1/models`, raw, { method: 'GET' });
      expectClientOutcome(raw, reply);
    }),
    fuzzParameters(60),
  );
});
