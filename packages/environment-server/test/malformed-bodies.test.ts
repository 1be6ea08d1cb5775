/**
 * Every data-plane route of the environment server answers a malformed request as the client's
 * mistake: below 500, in the standard JSON error shape (issue 24 item 9). The agent and resources
 * servers behind it are stubs on loopback.
 */
import fc from 'fast-check';

import { Harness, runBody } from './support/harness.js';
import {
  closeConnections,
  expectClientOutcome,
  fuzzParameters,
  malformedRequest,
  send,
} from '@ckpt-gym/testing';

const ROW = {
  responses_create_params: { input: 'weather in Paris?' },
  agent_ref: { name: 'simple_agent' },
  expected_city: 'Paris',
  _ng_task_index: 4,
  _ng_rollout_index: 2,
  _ng_attempt_index: 0,
};

const METRICS = {
  verify_responses: [{ reward: 1, response: { output: [] }, expected_city: 'Paris' }],
};

afterAll(closeConnections);

describe.each([
  ['off', false],
  ['on', true],
])('with checkpointing %s', (_name, checkpoint) => {
  const routes = [
    ['/run', { legacy: false }, runBody('r1')],
    ['/aggregate_metrics', { legacy: false }, METRICS],
    ['the legacy app /run', { legacy: true }, ROW],
  ] as const;

  test.each(routes)(
    '%s answers malformed bodies with client errors',
    async (route, options, valid) => {
      const h = await new Harness({ checkpoint, ...options }).start();
      const path = route.startsWith('/') ? route : '/run';
      try {
        await fc.assert(
          fc.asyncProperty(malformedRequest(valid), async (raw) => {
            expectClientOutcome(raw, await send(`${h.url}${path}`, raw));
          }),
          fuzzParameters(150),
        );
      } finally {
        await h.close();
      }
    },
  );
});
