/**
 * Every data-plane route of the agent server answers a malformed request as the client's mistake:
 * below 500, in the standard JSON error shape (issue 24 item 9): Simple Agent with checkpointing
 * off and on, and restart-only (Simple Agent's loop without its session hooks). The model and
 * resources servers are stubs on loopback.
 */
import fc from 'fast-check';

import type { Agent, AgentDefinition } from '../src/agent.js';
import { simpleAgent, type SimpleSessionState } from '../src/simple-agent.js';
import { type Harness, seed, startStack, weatherAccess } from './support/harness.js';
import {
  closeConnections,
  expectClientOutcome,
  fuzzParameters,
  jsonRequest,
  malformedRequest,
  send,
} from '@ckpt-gym/testing';

afterAll(closeConnections);

/** Simple Agent's loop and seeds without its session hooks: restart-only under checkpointing. */
const hookless: AgentDefinition<SimpleSessionState> = (context) => {
  const inner = simpleAgent(context);
  const agent: Agent<SimpleSessionState> = {
    checkpointSessionsSupported: false,
    seedSession: (request) => inner.seedSession(request),
    respond: (invocation) => inner.respond(invocation),
    legacyRun: (request) => inner.legacyRun(request),
    closeSession: (entry) => inner.closeSession(entry),
  };
  return agent;
};

const ACTIVATION = {
  input: [{ role: 'user', content: 'What is the weather in SF?', type: 'message' }],
  tools: [{ type: 'function', name: 'get_weather', parameters: {} }],
};

function seedBody(h: Harness, id: string) {
  return {
    agent_session_id: id,
    episode_id: { rollout_id: 'r1', attempt: 0 },
    task_id: 't1',
    tool_accesses: [weatherAccess(h.resources.url, 'r1')],
    sandbox_access: null,
  };
}

const RUN = {
  _ng_rollout_id: 'r1',
  responses_create_params: ACTIVATION,
  expected_city: 'SF',
};

describe.each([
  ['Simple Agent, checkpointing off', { checkpoint: false }],
  ['Simple Agent, checkpointing on', { checkpoint: true }],
  ['restart-only', { checkpoint: true, definition: hookless }],
])('%s', (_name, options) => {
  let h: Harness;
  beforeEach(async () => {
    h = await startStack(options);
  });
  afterEach(() => h.close());

  /** Fuzzes `path` from `valid`. */
  async function fuzz(path: string, valid: object) {
    await fc.assert(
      fc.asyncProperty(malformedRequest(valid), async (raw) => {
        expectClientOutcome(raw, await send(`${h.url}${path}`, raw));
      }),
      fuzzParameters(80),
    );
  }

  /** Malformed seeds of a session id no earlier run used (a reused id is only a conflict). */
  const seeds = () => fc.nat().chain((n) => malformedRequest(seedBody(h, `sess-${n}`)));

  test('/v1/agent_sessions answers malformed seeds with client errors', async () => {
    await fc.assert(
      fc.asyncProperty(seeds(), async (raw) => {
        expectClientOutcome(raw, await send(`${h.url}/ng-rollout/r1/v1/agent_sessions`, raw));
      }),
      fuzzParameters(80),
    );
  });

  test('a session from any seed the server accepted activates and closes without a server error', async () => {
    await fc.assert(
      fc.asyncProperty(seeds(), async (raw) => {
        const seeded = await send(`${h.url}/ng-rollout/r1/v1/agent_sessions`, raw);
        expectClientOutcome(raw, seeded);
        if (seeded.status !== 200) return;
        const cookie = seeded.cookies.map((c) => c.split(';')[0]).join('; ');
        const activation = jsonRequest(ACTIVATION, 'a valid activation');
        expectClientOutcome(
          raw,
          await send(`${h.url}/ng-rollout/r1/v1/responses`, activation, { headers: { cookie } }),
        );
        const close = jsonRequest({ agent_session_id: JSON.parse(seeded.text).agent_session_id });
        expectClientOutcome(
          raw,
          await send(`${h.url}/v1/agent_sessions/close`, close, { headers: { cookie } }),
        );
      }),
      fuzzParameters(80),
    );
  });

  test('/v1/responses of a seeded session answers malformed bodies with client errors', async () => {
    let sessions = 0;
    await fc.assert(
      fc.asyncProperty(malformedRequest(ACTIVATION), async (raw) => {
        // A session each: one activated hundreds of times would keep every trajectory.
        sessions += 1;
        const session = await seed(h, `sess-${sessions}`, 'r1');
        expect(session.reply.status).toBe(200);
        const url = `${h.url}/ng-rollout/r1/v1/responses`;
        expectClientOutcome(raw, await send(url, raw, { headers: { cookie: session.cookie } }));
      }),
      fuzzParameters(80),
    );
  });

  test('/v1/responses without a session answers malformed bodies with client errors', async () => {
    await fuzz('/ng-rollout/r1/v1/responses', ACTIVATION);
  });

  test('/v1/agent_sessions/close answers malformed bodies with client errors', async () => {
    await seed(h, 'sess-1', 'r1');
    await fuzz('/ng-rollout/r1/v1/agent_sessions/close', {
      agent_session_id: 'sess-1',
      episode_id: { rollout_id: 'r1', attempt: 0 },
    });
  });

  test('/run answers malformed rows with client errors, the rollout named by the row', async () => {
    await fuzz('/run', RUN);
  });

  test('/run answers malformed rows with client errors, the rollout named by its indices', async () => {
    const { _ng_rollout_id: _named, ...row } = RUN;
    await fuzz('/run', { ...row, _ng_task_index: 4, _ng_rollout_index: 2, _ng_attempt_index: 0 });
  });

  test('/run answers malformed rows with client errors, the rollout named by the prefix', async () => {
    await fuzz('/ng-rollout/r1/run', RUN);
  });
});
