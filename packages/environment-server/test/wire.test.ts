/**
 * The bodies single_agent_turn sends are the wire contracts' own: each one its receiver would get
 * passes the receiver's parser (agent seed and close, native resources seed and close), and the
 * activation header reads back as index 1.
 */
import {
  AGENT_ACTIVATION_HEADER,
  parseActivationHeader,
  parseAgentCloseRequest,
  parseAgentSeedRequest,
  parseNativeCloseRequest,
  parseNativeSeedRequest,
} from '@ckpt-gym/core/protocol';

import { Harness, runBody } from './support/harness.js';
import { closeConnections } from '@ckpt-gym/testing';

let h: Harness | undefined;
afterEach(async () => {
  await h?.close();
  h = undefined;
});
afterAll(closeConnections);

const RECEIVERS: Record<string, (body: unknown) => unknown> = {
  '/v1/agent_sessions': parseAgentSeedRequest,
  '/v1/agent_sessions/close': parseAgentCloseRequest,
  '/seed_session': parseNativeSeedRequest,
  '/close_session': parseNativeCloseRequest,
};

test.each([true, false])(
  'every session body an episode sends passes its receiver’s parser unchanged (checkpointing %s)',
  async (checkpoint) => {
    h = await new Harness({ checkpoint }).start();
    expect((await h.run(runBody('r1', 1))).status).toBe(200);
    const calls = [...h.resources.calls, ...h.agent.calls].filter((c) => RECEIVERS[c.path]);
    expect(calls.map((c) => c.path).sort()).toEqual(Object.keys(RECEIVERS).sort());
    for (const call of calls) expect(RECEIVERS[call.path]!(call.body)).toEqual(call.body);
    const activation = h.agent.calls.find((c) => c.path === '/v1/responses')!;
    expect(parseActivationHeader(activation.headers[AGENT_ACTIVATION_HEADER] as string)).toBe(1);
  },
);
