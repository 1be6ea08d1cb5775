/**
 * Every data-plane route of the resources servers answers a malformed request as the client's
 * mistake: below 500, in the standard JSON error shape (issue 24 item 9): the counter (exported)
 * and weather (stateless) servers, with checkpointing off and on; seeds native and legacy.
 */
import fc from 'fast-check';

import { counterServer, type ResourcesServerDefinition, weatherServer } from '../src/index.js';
import {
  closeConnections,
  expectClientOutcome,
  fuzzParameters,
  jsonRequest,
  malformedRequest,
  send,
} from '@ckpt-gym/testing';
import { cleanUp, episodeJson, responseCalling, startServer, type TestServer } from './support.js';

afterEach(cleanUp);
afterAll(closeConnections);

/** A native seed of session `id` for rollout r1. */
function nativeSeed(id: string) {
  return {
    resources_session_id: id,
    episode_id: episodeJson('r1'),
    task_id: { taskset: 'ts', task_id: 't1' },
    task_data: { initial_count: 1, expected_count: 3, expected_city: 'SF' },
  };
}

interface ServerCase {
  definition: () => ResourcesServerDefinition;
  /** Tool routes with a valid body each. */
  tools: Record<string, object>;
}

const SERVERS: Record<string, ServerCase> = {
  counter: {
    definition: counterServer,
    tools: { '/increment_counter': { count: 2 }, '/get_counter_value': {} },
  },
  weather: { definition: weatherServer, tools: { '/get_weather': { city: 'SF' } } },
};

const VERIFY = { response: responseCalling('get_weather'), expected_count: 3 };

describe.each(
  Object.entries(SERVERS).flatMap(
    ([name, c]) =>
      [
        [`${name}, checkpointing off`, c, false],
        [`${name}, checkpointing on`, c, true],
      ] as const,
  ),
)('%s', (_name, server, checkpoint) => {
  let s: TestServer;
  let sessions = 0;
  beforeEach(async () => {
    s = await startServer(server.definition(), { checkpoint });
  });

  /** A fresh session (natively seeded) and its cookie: one per run, never a closed one. */
  async function session(): Promise<{ id: string; cookie: string }> {
    sessions += 1;
    const id = `rs-${sessions}`;
    const reply = await send(`${s.url}/ng-rollout/r1/seed_session`, jsonRequest(nativeSeed(id)));
    expect(reply.status).toBe(200);
    return { id, cookie: reply.cookies.map((c) => c.split(';')[0]).join('; ') };
  }

  /** Fuzzes `path` under the r1 prefix, each run in a fresh session when `seeded`. */
  async function fuzz(path: string, valid: (id: string) => object, seeded = true) {
    await fc.assert(
      fc.asyncProperty(
        fc.nat().chain((n) => malformedRequest(valid(`rs-new-${n}`))),
        async (raw) => {
          const headers = seeded ? { cookie: (await session()).cookie } : undefined;
          const url = `${s.url}/ng-rollout/r1${path}`;
          expectClientOutcome(raw, await send(url, raw, headers ? { headers } : {}));
        },
      ),
      fuzzParameters(80),
    );
  }

  test('/seed_session answers malformed native seeds with client errors', async () => {
    await fuzz('/seed_session', nativeSeed, false);
  });

  test('/seed_session answers malformed legacy seeds with client errors', async () => {
    await fuzz('/seed_session', () => ({ initial_count: 1, expected_count: 3 }), false);
  });

  test('/verify answers malformed bodies with client errors', async () => {
    await fuzz('/verify', () => VERIFY);
  });

  test('/close_session answers malformed native closes with client errors', async () => {
    await fuzz('/close_session', () => ({
      resources_session_id: `rs-${sessions}`,
      episode_id: episodeJson('r1'),
    }));
  });

  test('/close_session answers malformed legacy closes with client errors', async () => {
    await fuzz('/close_session', () => ({}));
  });

  test('/aggregate_metrics answers malformed bodies with client errors', async () => {
    await fuzz('/aggregate_metrics', () => ({ verify_responses: [{ reward: 1 }, VERIFY] }), false);
  });

  test.each(Object.keys(server.tools))(
    '%s answers malformed bodies with client errors',
    async (tool) => {
      await fuzz(tool, () => server.tools[tool]!);
    },
  );
});
