/**
 * The environment participant through real HTTP: the #3885 validation list, begin's checks,
 * restarts, export and restore. Agent and resources are stub servers.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { CheckpointStateError, encodeJson } from '@ckpt-gym/core/protocol';
import { RECORD_FIELDS_JSON } from '@ckpt-gym/core/server';
import {
  AGENT_RESPONSE,
  type Behaviour,
  Gate,
  OBSERVATIONS,
  until,
  writeCorruptedCopy,
} from '@ckpt-gym/testing';
import { jest } from '@jest/globals';

import { EnvironmentParticipant, type EnvironmentRecord, taskDigest } from '../src/participant.js';
import type { EnvironmentProtocol } from '../src/protocol.js';
import { Harness, type HarnessOptions, runBody } from './support/harness.js';

const R1 = { rollout_id: 'r1', attempt: 0 };
const R1_A1 = { rollout_id: 'r1', attempt: 1 };

let root = '';
const harnesses: Harness[] = [];
beforeEach(async () => {
  root = await mkdtemp(join(tmpdir(), 'env-ckpt-'));
});
afterEach(async () => {
  for (const x of harnesses.splice(0)) await x.close();
  await rm(root, { recursive: true, force: true });
});

/** A fresh environment server process over fresh stubs, sharing the test's checkpoint root. */
async function server(options: HarnessOptions = {}): Promise<Harness> {
  const x = await new Harness({ dir: root, ...options }).start();
  harnesses.push(x);
  return x;
}

/** Simulates a crash of every gym process: the server and its stubs go away. */
async function crash(x: Harness): Promise<void> {
  harnesses.splice(harnesses.indexOf(x), 1);
  await x.close();
}

function episodeState(x: Harness, key: string) {
  return x.env.participant!.steps.state(key)?.state;
}

function failureOf(reply: { body: Record<string, unknown> }): Record<string, unknown> {
  return reply.body.failure as Record<string, unknown>;
}

/** Starts r1 with its activation held on a gate (then behaving as `behaviour`), once it arrived. */
async function heldActivation(x: Harness, behaviour: Behaviour = {}) {
  const activation = new Gate();
  x.agent.on('/v1/responses', { gate: activation, ...behaviour });
  const run = x.run(runBody('r1'));
  await x.agent.arrived('/v1/responses');
  return { activation, run };
}

/** Starts r1 with its activation held, checkpoints it (parked at invoke_agent) as `id`. */
async function checkpointDuringActivation(x: Harness, id = 'c1') {
  const activation = new Gate();
  x.agent.on('/v1/responses', { gate: activation });
  const run = x.run(runBody('r1'));
  run.catch(() => undefined);
  await x.agent.arrived('/v1/responses');
  expect((await x.prepare(id)).body.phase).toBe('prepared');
  const commit = await x.commit(id, [R1]);
  expect(commit.body.episode_ids).toEqual(['r1']);
  return { activation, run };
}

/** r1 checkpointed as c1 during its activation, the server crashed, and c1 restored in a fresh one. */
async function restoredInFreshServer() {
  const first = await server();
  await checkpointDuringActivation(first);
  await crash(first);
  const second = await server();
  await second.restore('c1', [R1]);
  return { first, second };
}

describe('begin', () => {
  it('refuses a retired attempt with stale_attempt until the rollout is forgotten', async () => {
    const x = await server();
    expect((await x.retire([R1])).status).toBe(200);
    const refused = await x.run(runBody('r1'));
    expect(refused.status).toBe(409);
    expect(refused.body.error).toEqual({
      code: 'stale_attempt',
      detail: "rollout 'r1' attempt 0 was retired",
    });
    expect(x.resources.calls).toEqual([]);
    await x.forget(['r1']);
    expect((await x.run(runBody('r1'))).body.result).toMatchObject({ reward: 1 });
  });

  it('refuses a new episode with admission_closed while a checkpoint is open', async () => {
    const x = await server();
    await x.prepare('c1');
    const refused = await x.run(runBody('r1'));
    expect(refused.status).toBe(409);
    expect((refused.body.error as Record<string, unknown>).code).toBe('admission_closed');
    await x.resume('c1');
    expect((await x.run(runBody('r1'))).status).toBe(200);
  });

  it('checks retired before admission closed', async () => {
    const x = await server();
    await x.retire([R1]);
    await x.prepare('c1');
    expect(((await x.run(runBody('r1'))).body.error as Record<string, unknown>).code).toBe(
      'stale_attempt',
    );
  });

  it('refuses a duplicate /run of a live attempt, and the refused request owns nothing', async () => {
    const x = await server();
    const activation = new Gate();
    x.agent.on('/v1/responses', { gate: activation });
    const live = x.run(runBody('r1'));
    await x.agent.arrived('/v1/responses');
    const duplicate = await x.run(runBody('r1'));
    expect(duplicate.status).toBe(409);
    expect(duplicate.body.error).toEqual({
      code: 'checkpoint_error',
      detail: 'episode r1 is already running',
    });
    // Nothing was closed for the refused request and the live one is still tracked.
    expect(x.agent.count('/v1/agent_sessions/close')).toBe(0);
    expect(x.resources.count('/close_session')).toBe(0);
    expect(x.report().counts).toEqual({ episodes: 1 });
    activation.open();
    expect((await live).body.result).toMatchObject({ reward: 1 });
    expect(x.resources.count('/close_session')).toBe(1);
  });

  it('untracks an episode whose final cleanup was cut short', async () => {
    const x = await server({ cleanupTimeoutSeconds: 0.2 });
    x.resources.on('/close_session', { gate: new Gate() });
    const reply = await x.run(runBody('r1'));
    expect(reply.body.result).toMatchObject({ reward: 1 });
    expect(x.report().counts).toEqual({ episodes: 0 });
    expect((await x.run(runBody('r1'))).status).toBe(200);
  });
});

describe('retire', () => {
  it('does not interrupt an episode in its final cleanup', async () => {
    const x = await server();
    const close = new Gate();
    x.resources.on('/close_session', { gate: close });
    const run = x.run(runBody('r1'));
    await x.resources.arrived('/close_session');
    const retire = x.retire([R1]);
    await until(() => x.env.participant!.steps.state('r1')?.retired === true, 'the retire');
    close.open();
    expect((await retire).body).toEqual({ retired_count: 1 });
    const reply = await run;
    // Not cancelled: the verdict stands and the close completed.
    expect(reply.body.result).toMatchObject({ reward: 1 });
    expect(x.resources.calls.find((c) => c.path === '/close_session')!.finished).toBe(true);
  });

  it('replies only after the episode and its cleanup have ended', async () => {
    const x = await server();
    x.agent.on('/v1/responses', { gate: new Gate() });
    const close = new Gate();
    x.resources.on('/close_session', { gate: close });
    const run = x.run(runBody('r1'));
    await x.agent.arrived('/v1/responses');
    let retired = false;
    const retire = x.retire([R1]).then((r) => {
      retired = true;
      return r;
    });
    await x.resources.arrived('/close_session');
    // The cancelled episode closed its agent session, and now waits on the resources close.
    expect(x.agent.count('/v1/agent_sessions/close')).toBe(1);
    await new Promise((resolve) => setTimeout(resolve, 50));
    expect(retired).toBe(false);
    close.open();
    expect((await retire).status).toBe(200);
    expect(x.report().counts).toEqual({ episodes: 0 });
    const reply = await run;
    expect(reply.status).toBe(409);
    expect((reply.body.error as Record<string, unknown>).code).toBe('stale_attempt');
  });

  it('cut short by its deadline blocks the next prepare, is not committed, and a retry after resume frees it', async () => {
    const x = await server();
    x.agent.on('/v1/responses', { gate: new Gate() });
    const close = new Gate();
    x.resources.on('/close_session', { gate: close });
    const run = x.run(runBody('r1'));
    await x.agent.arrived('/v1/responses');
    const cut = await x.retire([R1], 0.3);
    expect((cut.body.error as Record<string, unknown>).code).toBe('deadline_exceeded');
    const prepare = await x.prepare('c1', 0.3);
    expect(prepare.body.phase).toBe('preparing');
    expect((prepare.body.report as Record<string, unknown>).blockers).toEqual(['r1']);
    const commit = await x.commit('c1', null);
    expect(commit.status).toBe(409);
    await x.resume('c1');
    // Forget is refused while the retired attempt still runs.
    expect(((await x.forget(['r1'])).body.error as Record<string, unknown>).code).toBe(
      'retire_incomplete',
    );
    const retry = x.retire([R1]);
    close.open();
    expect((await retry).status).toBe(200);
    expect(x.report().counts).toEqual({ episodes: 0 });
    expect((await run).status).toBe(409);
    expect((await x.forget(['r1'])).body).toEqual({ forgotten_count: 1 });
  });

  it('stops an episode parked after its replay step raised', async () => {
    const x = await server();
    const { activation, run } = await heldActivation(x, { status: 500 });
    await x.prepare('c1');
    activation.open();
    await until(() => episodeState(x, 'r1') === 'parked', 'the failed step to park');
    // The control route refuses retire while prepared, so drive the participant's hook.
    await x.env.participant!.retire(R1);
    expect(x.report().counts).toEqual({ episodes: 0 });
    const reply = await run;
    expect((reply.body.error as Record<string, unknown>).code).toBe('stale_attempt');
    await x.resume('c1');
  });
});

describe('checkpoints', () => {
  it('status lists every live episode, so a controller can commit everything in flight', async () => {
    const x = await server();
    const { activation, run } = await heldActivation(x);
    expect(await x.status()).toMatchObject({ episodes: ['r1'], restored_pending: [] });
    activation.open();
    expect((await run).body.result).toMatchObject({ reward: 1 });
    expect((await x.status()).episodes).toEqual([]);
  });

  it('an agent that returns during a checkpoint parks at close_agent and stays ready', async () => {
    const x = await server();
    const { activation, run } = await heldActivation(x);
    expect((await x.prepare('c1')).body.phase).toBe('prepared');
    activation.open();
    await until(() => episodeState(x, 'r1') === 'parked', 'the episode to park');
    expect(x.env.participant!.ready()).toBe(true);
    expect(x.agent.count('/v1/agent_sessions/close')).toBe(0);
    await x.commit('c1', [R1]);
    const [record] = await x.records('c1');
    expect(record!.boundary).toMatchObject({ next: 'close_agent', response: AGENT_RESPONSE });
    await x.resume('c1');
    expect((await run).body.result).toMatchObject({ reward: 1 });
  });

  it('a restore at close_agent closes and verifies without invoking the agent', async () => {
    const first = await server();
    const activation = new Gate();
    first.agent.on('/v1/responses', { gate: activation });
    first.background(runBody('r1'));
    await first.agent.arrived('/v1/responses');
    await first.prepare('c1');
    activation.open();
    await until(() => episodeState(first, 'r1') === 'parked', 'the episode to park');
    await first.commit('c1', [R1]);
    await crash(first);

    const second = await server();
    expect((await second.restore('c1', [R1])).body.restored).toEqual(['r1-a1']);
    await second.resume('c1');
    const reply = await second.run(runBody('r1', 1));
    expect(reply.body.result).toEqual({
      reward: 1,
      response: AGENT_RESPONSE,
      ng_agent_observations: OBSERVATIONS,
    });
    expect(second.agent.paths()).toEqual(['/v1/agent_sessions/close']);
    expect(second.resources.paths()).toEqual(['/verify', '/close_session']);
    expect(second.resources.calls.every((c) => c.key === 'r1-a1')).toBe(true);
  });

  it('an episode in a replay step is exported with its fields already JSON, as the store would write them', async () => {
    const x = await server();
    x.agent.on('/v1/responses', { gate: new Gate() });
    x.background(runBody('r1'));
    await x.agent.arrived('/v1/responses');
    const [record] = await x.env.participant!.export([R1]);
    const pieces = record![RECORD_FIELDS_JSON];
    expect(pieces?.join('')).toBe(
      encodeJson({ task_digest: record!.task_digest, boundary: record!.boundary }).slice(1, -1),
    );
    expect(record!.boundary).toMatchObject({ next: 'invoke_agent' });
  });

  it('a commit does not export live episodes outside its scope', async () => {
    const x = await server();
    x.agent.on('/v1/responses', { gate: new Gate() });
    x.background(runBody('r1'));
    x.background(runBody('r2'));
    await x.agent.arrived('/v1/responses', 2);
    await x.prepare('c1');
    expect((await x.commit('c1', [R1])).body.episode_ids).toEqual(['r1']);
    expect((await x.records('c1')).map((r) => r.episode_id)).toEqual([R1]);
  });

  it('a replay step that fails during a checkpoint is exported with no boundary, replies only after resume, and starts over after a crash', async () => {
    const first = await server();
    const activation = new Gate();
    first.agent.on('/v1/responses', { gate: activation, status: 500 });
    let replied = false;
    const run = first.run(runBody('r1')).then((r) => {
      replied = true;
      return r;
    });
    await first.agent.arrived('/v1/responses');
    expect((await first.prepare('c1')).body.phase).toBe('prepared');
    activation.open();
    await until(() => episodeState(first, 'r1') === 'parked', 'the failed step to park');
    expect(first.env.participant!.ready()).toBe(true);
    const commit = await first.commit('c1', [R1]);
    expect(commit.body.episode_ids).toEqual(['r1']);
    expect((await first.records('c1'))[0]!.boundary).toBeNull();
    // Neither the agent close nor the reply happen while Gym is prepared.
    expect(replied).toBe(false);
    expect(first.agent.count('/v1/agent_sessions/close')).toBe(0);
    expect(first.resources.count('/close_session')).toBe(0);
    await first.resume('c1');
    const reply = await run;
    expect(failureOf(reply)).toMatchObject({
      stage: 'agent',
      terminal: false,
      ng_agent_observations: OBSERVATIONS,
    });
    await crash(first);

    const second = await server();
    await second.restore('c1', [R1]);
    await second.resume('c1');
    expect((await second.run(runBody('r1', 1))).body.result).toMatchObject({ reward: 1 });
    expect(second.resources.paths()[0]).toBe('/seed_session');
  });

  it('an agent failure during a checkpoint closes the agent session only after resume', async () => {
    const x = await server();
    const { activation, run } = await heldActivation(x, { status: 503 });
    await x.prepare('c1');
    activation.open();
    await until(() => episodeState(x, 'r1') === 'parked', 'the failed step to park');
    expect(x.agent.count('/v1/agent_sessions/close')).toBe(0);
    await x.resume('c1');
    const reply = await run;
    expect(x.agent.count('/v1/agent_sessions/close')).toBe(1);
    expect(failureOf(reply).ng_agent_observations).toEqual(OBSERVATIONS);
  });

  it('replacements are refused until the controller resumes, then continue from the boundary', async () => {
    const { second } = await restoredInFreshServer();
    expect((await second.status()).restored_pending).toEqual(['r1-a1']);
    const early = await second.run(runBody('r1', 1));
    expect((early.body.error as Record<string, unknown>).code).toBe('admission_closed');
    await second.resume('c1');
    const reply = await second.run(runBody('r1', 1));
    expect(reply.body.result).toMatchObject({ reward: 1 });
    // Continued at invoke_agent: the seeds are not sent again.
    expect(second.agent.paths()).toEqual(['/v1/responses', '/v1/agent_sessions/close']);
    expect((await second.status()).restored_pending).toEqual([]);
  });

  it('refuses a replacement for another task with checkpoint_error', async () => {
    const { second } = await restoredInFreshServer();
    await second.resume('c1');
    const other = await second.run(runBody('r1', 1, { expected_city: 'Rome' }));
    expect(other.body.error).toEqual({
      code: 'checkpoint_error',
      detail: 'episode r1-a1 continues a checkpoint recorded for a different task',
    });
    expect((await second.status()).restored_pending).toEqual(['r1-a1']);
  });

  it('checks admission before the task digest', async () => {
    const { second } = await restoredInFreshServer();
    const other = await second.run(runBody('r1', 1, { expected_city: 'Rome' }));
    expect((other.body.error as Record<string, unknown>).code).toBe('admission_closed');
  });

  it('re-exports an unclaimed restored episode under its replacement attempt, and a second crash continues it', async () => {
    const { first, second } = await restoredInFreshServer();
    await second.resume('c1');
    await second.prepare('c2');
    expect((await second.commit('c2', [R1_A1])).body.episode_ids).toEqual(['r1-a1']);
    const [original] = await first.records('c1');
    const [carried] = await second.records('c2');
    expect(carried).toEqual({ ...original, episode_id: R1_A1 });
    await second.resume('c2');
    await crash(second);
    const third = await server();
    expect((await third.restore('c2', [R1_A1])).body.restored).toEqual(['r1-a2']);
    await third.resume('c2');
    expect((await third.run(runBody('r1', 2))).body.result).toMatchObject({ reward: 1 });
  });

  it('a restored boundary that is not JSON restores; its replacement /run is a typed error naming it, the others run', async () => {
    const R2 = { rollout_id: 'r2', attempt: 0 };
    const first = await server();
    first.agent.on('/v1/responses', { gate: new Gate() });
    for (const r of ['r1', 'r2']) first.run(runBody(r)).catch(() => undefined);
    await first.agent.arrived('/v1/responses', 2);
    expect((await first.prepare('c1')).body.phase).toBe('prepared');
    expect((await first.commit('c1', [R1, R2])).body.episode_ids).toEqual(['r1', 'r2']);
    await crash(first);
    // The store writes the copy: digest, count and episodes are right; r1's boundary is not JSON.
    await writeCorruptedCopy({
      from: first.checkpointDir('c1'),
      to: first.checkpointDir('c2'),
      kind: 'environment',
      instance: 'env',
      checkpointId: 'c2',
      rollout: 'r1',
      field: 'boundary',
      // Past DEFER_DECODE_MIN_BYTES: a smaller record is decoded (and refused) at restore.
      text: `{"stage":nope,"pad":"${'x'.repeat(20_000)}"}`,
    });
    const second = await server();
    expect((await second.restore('c2', [R1, R2])).body.restored).toEqual(['r1-a1', 'r2-a1']);
    await second.resume('c2');
    for (let i = 0; i < 2; i++) {
      const broken = await second.run(runBody('r1', 1));
      expect(broken.body.error).toMatchObject({ code: 'invalid_checkpoint_state' });
      expect(JSON.stringify(broken.body.error)).toContain("'r1'");
    }
    expect((await second.status()).restored_pending).toEqual(['r1-a1', 'r2-a1']);
    expect((await second.run(runBody('r2', 1))).body.result).toMatchObject({ reward: 1 });
  });

  it('a commit whose scope leaves out a restored episode retires it', async () => {
    const { second } = await restoredInFreshServer();
    await second.resume('c1');
    await second.prepare('c2');
    const commit = await second.commit('c2', [{ rollout_id: 'other', attempt: 0 }]);
    expect(commit.body.episode_ids).toEqual([]);
    expect((await second.status()).restored_pending).toEqual([]);
    await second.resume('c2');
    // No mark was left: the controller may start that attempt over from its input.
    const fresh = await second.run(runBody('r1', 1));
    expect(fresh.body.result).toMatchObject({ reward: 1 });
    expect(second.resources.paths()[0]).toBe('/seed_session');
  });

  it.each(['close_agent', 'return'])(
    'a replacement restored at %s and admitted during a second checkpoint parks before its stage',
    async (stage) => {
      const first = await server();
      const gate = new Gate();
      if (stage === 'close_agent') {
        first.agent.on('/v1/responses', { gate });
      } else {
        first.resources.on('/seed_session', { headers: { 'x-ng-checkpoint-verify': 'replay' } });
        first.resources.on('/verify', { gate });
      }
      first.background(runBody('r1'));
      await (stage === 'close_agent'
        ? first.agent.arrived('/v1/responses')
        : first.resources.arrived('/verify'));
      await first.prepare('c1');
      gate.open();
      await until(() => episodeState(first, 'r1') === 'parked', 'the episode to park');
      await first.commit('c1', [R1]);
      const [record] = await first.records('c1');
      expect((record!.boundary as Record<string, unknown>).next).toBe(stage);
      await crash(first);

      const second = await server();
      await second.restore('c1', [R1]);
      await second.resume('c1');
      expect((await second.prepare('c2')).body.phase).toBe('prepared');
      let replied = false;
      const run = second.run(runBody('r1', 1)).then((r) => {
        replied = true;
        return r;
      });
      await until(() => episodeState(second, 'r1-a1') === 'parked', 'the replacement to park');
      expect(second.env.participant!.ready()).toBe(true);
      expect((await second.status()).report).toMatchObject({ ready: true, blocker_count: 0 });
      expect([...second.agent.calls, ...second.resources.calls]).toEqual([]);
      await second.commit('c2', [R1_A1]);
      const [again] = await second.records('c2');
      expect(again!.boundary).toEqual(record!.boundary);
      expect(replied).toBe(false);
      await second.resume('c2');
      expect((await run).body.result).toMatchObject({ reward: 1 });
      expect(second.resources.count('/close_session')).toBe(1);
    },
  );

  it('keeps the verify mode in the handles so a restored episode replays a replayable verify', async () => {
    const first = await server();
    first.resources.on('/seed_session', { headers: { 'x-ng-checkpoint-verify': 'replay' } });
    first.resources.on('/verify', { gate: new Gate() });
    first.background(runBody('r1'));
    await first.resources.arrived('/verify');
    // A replayable verify does not hold up the checkpoint; the verify boundary is exported.
    expect((await first.prepare('c1')).body.phase).toBe('prepared');
    await first.commit('c1', [R1]);
    const [record] = await first.records('c1');
    expect(record!.boundary).toMatchObject({
      next: 'verify',
      handles: { resources_verify: 'replay' },
      observations: OBSERVATIONS,
    });
    await crash(first);
    const second = await server();
    await second.restore('c1', [R1]);
    await second.resume('c1');
    await second.run(runBody('r1', 1));
    const verify = second.resources.calls.find((c) => c.path === '/verify')!;
    expect(verify.headers['x-ng-checkpoint-close-follows']).toBe('1');
  });
});

describe('restore', () => {
  it('is refused by a process with live episodes', async () => {
    const first = await server();
    await checkpointDuringActivation(first);
    await first.resume('c1');
    // r1 is still running in this process.
    const refused = await first.control('restore', {
      checkpoint_id: 'restore-1',
      deadline_ts: Date.now() / 1000 + 30,
      checkpoint_dir: first.checkpointDir('c1'),
      episode_ids: [R1],
    });
    expect(refused.body.error).toEqual({
      code: 'checkpoint_error',
      detail: 'environment restore requires a process without live episodes',
    });
  });

  it('validates records: a bad digest or boundary is invalid_checkpoint_state', () => {
    const participant = new EnvironmentParticipant('env');
    const good = { episode_id: R1, task_digest: 'a'.repeat(64), boundary: null };
    expect(participant.validateRecord(good, 'r1')).toEqual(good);
    expect(() => participant.validateRecord({ ...good, task_digest: 'xyz' }, 'r1')).toThrow(
      CheckpointStateError,
    );
    expect(() => participant.validateRecord({ ...good, boundary: [1] }, 'r1')).toThrow(
      CheckpointStateError,
    );
    expect(() => participant.validateRecord({ ...good, extra: 1 }, 'r1')).toThrow(
      CheckpointStateError,
    );
  });
});

describe('retire of restored records', () => {
  const record = (rollout_id: string, attempt: number) => ({
    episode_id: { rollout_id, attempt },
    task_digest: 'a'.repeat(64),
    boundary: null,
  });

  it('frees the restored records of exactly the covered attempts, looked up or scanned', async () => {
    const participant = new EnvironmentParticipant('env');
    // Replacements r1-a1, r1-a3, r2-a1 and r10-a1 (r10 must not match r1).
    await participant.install([
      record('r1', 0),
      record('r1', 2),
      record('r2', 0),
      record('r10', 0),
    ]);
    const pending = () =>
      participant
        .restoredPending()
        .map((e) => `${e.rollout_id}@${e.attempt}`)
        .sort();
    // Looked up attempt by attempt (fewer attempts than tracked records): r1-a3 is not covered.
    await participant.retire({ rollout_id: 'r1', attempt: 2 });
    expect(pending()).toEqual(['r10@1', 'r1@3', 'r2@1']);
    // An attempt beyond the number of tracked records takes the scan.
    await participant.retire({ rollout_id: 'r1', attempt: 1_000_000 });
    expect(pending()).toEqual(['r10@1', 'r2@1']);
    await participant.retire({ rollout_id: 'r2', attempt: 0 });
    expect(pending()).toEqual(['r10@1', 'r2@1']);
  });
});

describe('restarts', () => {
  async function restartIsReported(x: Harness) {
    x.agent.on('/v1/responses', { gate: new Gate() });
    x.background(runBody('r1'));
    await x.agent.arrived('/v1/responses');
    const prepare = await x.prepare('c1');
    expect(prepare.body.phase).toBe('prepared');
    expect((prepare.body.report as Record<string, unknown>).restarts).toEqual(['r1']);
    expect((await x.commit('c1', null)).body.episode_ids).toEqual([]);
  }

  it('an episode whose resources seed reply says restart is a restart', async () => {
    const x = await server();
    x.resources.on('/seed_session', { headers: { 'x-ng-checkpoint-restart': '1' } });
    await restartIsReported(x);
  });

  it('an episode whose agent seed reply says restart is a restart', async () => {
    const x = await server();
    x.agent.on('/v1/agent_sessions', { headers: { 'x-ng-checkpoint-restart': '1' } });
    await restartIsReported(x);
  });

  it('an episode that grants MCP access is a restart', async () => {
    const x = await server({ transports: ['mcp'] });
    x.resources.on('/seed_session', {
      body: {
        resources_tools: { transport: 'http', server_name: 'weather_mcp', url_path: '/mcp' },
      },
    });
    await restartIsReported(x);
    expect(x.agent.calls[0]!.body.tool_accesses).toEqual([
      {
        kind: 'mcp',
        name: 'weather_mcp',
        required: true,
        connection: { transport: 'streamable_http', url: `${x.resources.url}/mcp`, headers: {} },
      },
    ]);
  });

  it('an episode that will grant MCP access is a restart while it seeds, so no checkpoint exports it', async () => {
    const x = await server({ transports: ['mcp'] });
    const seeding = new Gate();
    x.resources.on('/seed_session', {
      gate: seeding,
      body: {
        resources_tools: { transport: 'http', server_name: 'weather_mcp', url_path: '/mcp' },
      },
    });
    x.background(runBody('r1'));
    await x.resources.arrived('/seed_session');
    const prepare = await x.prepare('c1');
    expect(prepare.body.phase).toBe('prepared');
    expect((prepare.body.report as Record<string, unknown>).restarts).toEqual(['r1']);
    expect((await x.commit('c1', null)).body.episode_ids).toEqual([]);
    seeding.open();
  });

  it('a server whose protocol records no boundaries runs every episode as a restart', async () => {
    const gate = new Gate();
    const protocol: EnvironmentProtocol = {
      checkpointBoundaries: false,
      async run(_request, work) {
        await work.step('wait', () => gate.promise);
        return { reward: 1 };
      },
    };
    const x = await server({ protocol });
    const run = x.run(runBody('r1'));
    await until(() => x.report().counts.episodes === 1, 'the episode');
    const prepare = await x.prepare('c1');
    expect(prepare.body.phase).toBe('prepared');
    expect((prepare.body.report as Record<string, unknown>).restarts).toEqual(['r1']);
    const inScope = await x.commit('c1', [R1]);
    expect((inScope.body.error as Record<string, unknown>).code).toBe('restart_in_scope');
    await x.resume('c1');
    gate.open();
    expect((await run).body.result).toEqual({ reward: 1 });
  });
});

describe('readiness', () => {
  it('is answered from the blocker count without listing blockers', async () => {
    const x = await server();
    x.agent.on('/v1/responses', { gate: new Gate() });
    x.background(runBody('r1'));
    await until(() => x.report().counts.episodes === 1, 'the episode');
    const steps = x.env.participant!.steps;
    const blockers = jest.spyOn(steps, 'blockers');
    const readiness = jest.spyOn(x.env.participant!, 'readiness');
    for (let i = 0; i < 5; i += 1) x.env.participant!.ready();
    expect(blockers).not.toHaveBeenCalled();
    expect(readiness).not.toHaveBeenCalled();
    expect(x.env.participant!.ready()).toBe(steps.blockerCount() === 0);
  });
});

describe('on a worker of several: restored episodes claimed from the coordinator', () => {
  const task = { task_id: 't1' };
  const held = {
    episode_id: R1,
    task_digest: taskDigest(task),
    boundary: { turn: 3 },
  };

  /** A participant whose coordinator holds `record` (or lost it to another worker: null). */
  function onWorker(record: EnvironmentRecord | null) {
    const participant = new EnvironmentParticipant('env');
    const claimed: string[] = [];
    participant.claims = {
      holds: (key) => key === 'r1-a1',
      claim: (key) => {
        claimed.push(key);
        return Promise.resolve(record);
      },
    };
    return { participant, claimed };
  }

  const continuation = (participant: EnvironmentParticipant, episode = R1_A1) =>
    participant.run(episode, task, {}, (ep) => Promise.resolve(ep.continuation()));

  it('a replacement claims its restored record, then continues from its boundary', async () => {
    const { participant, claimed } = onWorker(held);
    expect(await continuation(participant)).toEqual({ turn: 3 });
    expect(claimed).toEqual(['r1-a1']);
    expect(participant.restoredPending()).toEqual([]);
  });

  it("another worker's claim won: the replacement is refused as a second run of a running attempt", async () => {
    const { participant, claimed } = onWorker(null);
    await expect(continuation(participant)).rejects.toMatchObject({ code: 'checkpoint_error' });
    expect(claimed).toEqual(['r1-a1']);
    expect(participant.steps.size).toBe(0);
  });

  it('a retired replacement is refused before it claims anything', async () => {
    const { participant, claimed } = onWorker(held);
    participant.marks.mark([R1_A1]);
    await expect(continuation(participant)).rejects.toMatchObject({ code: 'stale_attempt' });
    expect(claimed).toEqual([]);
  });

  it('an episode whose key the coordinator does not hold costs no claim', async () => {
    const { participant, claimed } = onWorker(held);
    expect(await continuation(participant, { rollout_id: 'r2', attempt: 1 })).toBeNull();
    expect(claimed).toEqual([]);
  });
});
