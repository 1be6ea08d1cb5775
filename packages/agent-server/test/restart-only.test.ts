import { ep, Gate, until } from '@ckpt-gym/testing';
import type { Express } from 'express';

import type { Agent, AgentDefinition } from '../src/agent.js';
import { installRestartOnly, RestartOnlyParticipant } from '../src/restart-only.js';
import { simpleAgent, type SimpleSessionState } from '../src/simple-agent.js';
import {
  activate,
  commit,
  errorCode,
  type Harness,
  post,
  prepare,
  restore,
  resume,
  retire,
  seed,
  startStack,
} from './support/harness.js';

/** Simple Agent's loop without its session hooks, with a route of its own and a gated seed. */
function hooklessAgent(gates: { seed?: Gate } = {}) {
  const calls = { close: [] as string[], seed: 0 };
  const definition: AgentDefinition<SimpleSessionState> = (context) => {
    const inner = simpleAgent(context);
    const agent: Agent<SimpleSessionState> = {
      checkpointSessionsSupported: false,
      seedSession: async (request) => {
        calls.seed += 1;
        await gates.seed?.promise;
        return inner.seedSession(request);
      },
      respond: (inv) => inner.respond(inv),
      legacyRun: (request) => inner.legacyRun(request),
      closeSession: async (entry) => {
        calls.close.push(entry.id);
        return inner.closeSession(entry);
      },
      setupRoutes(app: Express) {
        app.post('/harness/v1/responses', (_req, res) => {
          res.json({ ok: true });
        });
      },
    };
    return agent;
  };
  return { definition, calls };
}

function participant(h: Harness): RestartOnlyParticipant {
  return h.agent.participant as RestartOnlyParticipant;
}

describe('restart-only agents', () => {
  test('an agent without hooks gets a restart-only participant, installed once on its app', async () => {
    await using h = await startStack({ definition: hooklessAgent().definition });
    expect(participant(h)).toBeInstanceOf(RestartOnlyParticipant);
    expect(installRestartOnly(h.agent.app, participant(h))).toBe(false);
  });

  test('its runs are reported as restarts and never block, and its seed replies carry x-ng-checkpoint-restart', async () => {
    await using h = await startStack({ definition: hooklessAgent().definition });
    const s = await seed(h, 'sess-1', 'r1');
    expect(s.reply.headers.get('x-ng-checkpoint-restart')).toBe('1');
    const tool = h.resources.holdNext();
    const running = activate(h, s, 'r1');
    await tool.arrived;
    const prepared = await prepare(h, 'c1');
    expect(prepared.phase).toBe('prepared');
    expect(prepared.report.restarts).toEqual(['r1']);
    // It keeps running through the checkpoint.
    tool.gate.open();
    expect((await running).status).toBe(200);
    await resume(h, 'c1');
  });

  test('an agent that builds its own routes still reports its runs as restarts, and refuses calls without a rollout id', async () => {
    await using h = await startStack({ definition: hooklessAgent().definition });
    expect((await post(`${h.url}/ng-rollout/r7/harness/v1/responses`, {})).body).toEqual({
      ok: true,
    });
    const refused = await post(`${h.url}/harness/v1/responses`, {});
    expect(errorCode(refused)).toBe('rollout_id_required');
  });

  test('a restart-only seed that arrives after its rollout was retired is refused', async () => {
    await using h = await startStack({ definition: hooklessAgent().definition });
    await retire(h, [ep('r1')]);
    expect(errorCode((await seed(h, 'sess-1', 'r1')).reply)).toBe('stale_attempt');
  });

  test('a restart-only seed checks the retired mark after it waits for resume', async () => {
    const { definition, calls } = hooklessAgent();
    await using h = await startStack({ definition });
    await prepare(h, 'c1');
    await commit(h, 'c1', null);
    await resume(h, 'c1');
    // A restore leaves admission closed until resume; a retire is allowed meanwhile.
    expect((await restore(h, 'r-c1', [], 'c1')).status).toBe(200);
    const seeding = seed(h, 'sess-1', 'r1');
    await until(
      () => participant(h).readiness().counts.waiting_for_resume === 1,
      'the seed to wait',
    );
    expect((await retire(h, [ep('r1')], 30, 'r-c1')).status).toBe(200);
    await resume(h, 'r-c1');
    expect(errorCode((await seeding).reply)).toBe('stale_attempt');
    // Refused before it built anything.
    expect(calls.seed).toBe(0);
    expect(h.agent.sessions.size).toBe(0);
  });

  test('a restart-only retire stops its runs before it replies', async () => {
    await using h = await startStack({ definition: hooklessAgent().definition });
    const s = await seed(h, 'sess-1', 'r1');
    const held = h.model.holdNext();
    const running = activate(h, s, 'r1');
    await held.arrived;
    expect((await retire(h, [ep('r1')])).status).toBe(200);
    expect(participant(h).readiness().counts.inflight).toBe(0);
    expect(errorCode(await running)).toBe('stale_attempt');
    held.gate.open();
  });

  test('a restart-only agent’s /run has stopped when its retire replies', async () => {
    await using h = await startStack({ definition: hooklessAgent().definition });
    const held = h.model.holdNext();
    const running = post(`${h.url}/ng-rollout/r1/run`, {
      responses_create_params: { input: 'weather?' },
    });
    await held.arrived;
    expect(participant(h).readiness().restarts).toEqual(['r1']);
    expect((await retire(h, [ep('r1')])).status).toBe(200);
    expect(participant(h).readiness().counts.inflight).toBe(0);
    expect(errorCode(await running)).toBe('stale_attempt');
    held.gate.open();
  });

  test('a restart-only retire frees its rollout’s sessions through the close hook and waits for a seed in progress', async () => {
    const gates = { seed: new Gate() };
    const { definition, calls } = hooklessAgent(gates);
    await using h = await startStack({ definition });
    gates.seed.open();
    await seed(h, 'sess-1', 'r1');
    await seed(h, 'sess-other', 'r2');
    const slow = new Gate();
    gates.seed = slow;
    // A second seed of r1 still in progress when the retire comes.
    const seeding = seed(h, 'sess-2', 'r1');
    await until(() => h.agent.sessions.building.has('sess-2'), 'the seed');
    let retired = false;
    const retiring = retire(h, [ep('r1')]).then(() => (retired = true));
    await until(() => participant(h).marks.isRetired(ep('r1')), 'the mark');
    expect(retired).toBe(false);
    slow.open();
    await retiring;
    expect(errorCode((await seeding).reply)).toBe('stale_attempt');
    expect(calls.close.sort()).toEqual(['sess-1', 'sess-2']);
    expect([...h.agent.sessions.values()].map((e) => e.id)).toEqual(['sess-other']);
  });
});
