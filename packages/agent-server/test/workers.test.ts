/**
 * An agent server of two workers under checkpointing (in this process, each worker on its own
 * port and socket): restored legacy `/run` records are claimed once, never while a checkpoint is
 * open; native sessions are placed by load, reached through their pre-crash owner's alias, and
 * exported once.
 */
import { mkdtemp, readdir, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { writeParticipantState } from '@ckpt-gym/core/server';
import {
  controlClient,
  ep,
  startStubModel,
  startStubToolResources,
  type StubModel,
  type StubToolResources,
  until,
} from '@ckpt-gym/testing';

import {
  activate,
  closeSession,
  commit,
  errorCode,
  post,
  prepare,
  restore,
  resume,
  seed,
  TOKEN,
} from './support/harness.js';
import { type AgentWorkers, startAgentWorkers } from './support/workers.js';

let model: StubModel;
let resources: StubToolResources;
let dir: string;
const servers: AgentWorkers[] = [];

beforeEach(async () => {
  model = await startStubModel();
  resources = await startStubToolResources();
  dir = await mkdtemp(join(tmpdir(), 'agent-workers-'));
});
afterEach(async () => {
  for (const s of servers.splice(0)) await s.close();
  await model.close();
  await resources.close();
  await rm(dir, { recursive: true, force: true });
});

async function twoWorkers(): Promise<AgentWorkers> {
  const s = await startAgentWorkers({ model, resources, dir });
  servers.push(s);
  return s;
}

/** The control calls' view of the server: any worker's URL, and the checkpoint root. */
const via = (s: AgentWorkers, worker = 0) => ({
  url: s.workers[worker]!.url,
  dir: s.dir,
  resources,
});

const RUN_BODY = {
  _ng_rollout_id: 'r1',
  responses_create_params: {
    input: 'What is the weather in SF?',
    tools: [{ type: 'function', name: 'get_weather', parameters: {} }],
  },
};

/** The restored attempts the server's status lists as pending (its coordinator's view). */
async function restoredPending(s: AgentWorkers): Promise<string[]> {
  await using client = controlClient(s.workers[0]!.url, TOKEN);
  return (await client.status()).restored_pending as string[];
}

/** A legacy `/run` of r1 on worker 1 checkpointed inside its turn loop, then a crash. */
async function legacyRunCheckpointed(): Promise<void> {
  const before = await twoWorkers();
  const first = model.holdNext();
  const abort = new AbortController();
  const running = post(`${before.workers[0]!.url}/run`, RUN_BODY, {}, abort.signal).catch(
    () => undefined,
  );
  await first.arrived;
  expect((await prepare(via(before), 'c1')).phase).toBe('prepared');
  expect(await commit(via(before), 'c1', [ep('r1')])).toEqual(['r1']);
  abort.abort();
  first.gate.open();
  await running;
  await before.close();
}

/** A fresh server of two workers that restored checkpoint `id` of `scope` (resumed). */
async function restored(id: string, scope: { rollout_id: string; attempt: number }[]) {
  const after = await twoWorkers();
  const reply = await restore(via(after), id, scope);
  expect([reply.status, reply.body]).toEqual([200, expect.anything()]);
  await resume(via(after), id);
  return after;
}

/** `sess-1` of r1 seeded on two workers, committed as c1, crashed and restored into two fresh ones. */
async function restoredSession() {
  const before = await twoWorkers();
  const s = await seed(via(before), 'sess-1', 'r1');
  expect(await commitAll(before, 'c1', ['r1'])).toEqual(['r1']);
  await before.close();
  return { s, after: await restored('c1', [ep('r1')]) };
}

describe('agent workers: a restored legacy /run', () => {
  test('two replacement /run calls on two workers: exactly one claims the episode and runs it, the other is 409', async () => {
    await legacyRunCheckpointed();
    const after = await restored('c1', [ep('r1')]);
    const replies = await Promise.all(
      after.workers.map((w) => post(`${w.url}/ng-rollout/r1-a1/run`, RUN_BODY)),
    );
    const ran = replies.filter((r) => r.status === 200);
    const refused = replies.filter((r) => r.status !== 200);
    expect(ran.map((r) => r.body.reward)).toEqual([1]);
    expect(refused.map((r) => [r.status, errorCode(r)])).toEqual([[409, 'checkpoint_error']]);
  });

  test('a claim is refused with admission_closed while a checkpoint is open, and succeeds after resume', async () => {
    await legacyRunCheckpointed();
    const after = await restored('c1', [ep('r1')]);
    expect((await prepare(via(after), 'c2')).phase).toBe('prepared');
    const closed = await post(`${after.workers[1]!.url}/ng-rollout/r1-a1/run`, RUN_BODY);
    expect([closed.status, errorCode(closed)]).toEqual([409, 'admission_closed']);
    await resume(via(after), 'c2');
    const reply = await post(`${after.workers[1]!.url}/ng-rollout/r1-a1/run`, RUN_BODY);
    expect([reply.status, reply.body.reward]).toEqual([200, 1]);
  });
});

describe('agent workers: native sessions', () => {
  test('a cookie naming a worker that no longer exists reaches the session on its new owner (alias)', async () => {
    const { s, after } = await restoredSession();
    // One owner's sessions go to the least-loaded worker, the first: send to the other one.
    expect(after.workers.map((w) => w.participant.has('sess-1'))).toEqual([true, false]);
    const reply = await activate({ url: after.workers[1]!.url }, s, 'r1-a1', 1);
    expect([reply.status, errorCode(reply)]).toEqual([200, undefined]);
    expect(reply.body.output).toBeDefined();
  });

  test('a restore places each pre-crash owner on the least-loaded live worker', async () => {
    const before = await twoWorkers();
    await seed(via(before, 0), 'a-1', 'r1');
    await seed(via(before, 0), 'a-2', 'r2');
    await seed(via(before, 1), 'b-1', 'r3');
    expect(await commitAll(before, 'c1', ['r1', 'r2', 'r3'])).toEqual(['r1', 'r2', 'r3']);
    await before.close();
    const after = await restored('c1', [ep('r1'), ep('r2'), ep('r3')]);
    const held = after.workers.map((w) =>
      ['a-1', 'a-2', 'b-1'].filter((id) => w.participant.has(id)),
    );
    expect(held).toEqual([['a-1', 'a-2'], ['b-1']]);
  });

  test('a commit exports one copy of a session seeded again on another worker, and frees the unused restored one', async () => {
    const { after } = await restoredSession();
    // A seed of the same session without its cookie lands on the other worker: a live copy there.
    const again = await seed(via(after, 1), 'sess-1', 'r1', { attempt: 1 });
    expect(again.reply.status).toBe(200);
    expect(after.workers.map((w) => w.participant.has('sess-1'))).toEqual([true, true]);
    expect(await commitAll(after, 'c2', ['r1'], 1)).toEqual(['r1-a1']);
    expect(after.workers.map((w) => w.participant.has('sess-1'))).toEqual([false, true]);
  });

  test('a restored session closed before any request used it is no longer pending on the coordinator', async () => {
    const { s, after } = await restoredSession();
    expect(await restoredPending(after)).toEqual(['r1-a1']);
    // The replacement attempt closes the session without an activation (its episode had ended).
    expect((await closeSession(via(after, 1), s, ep('r1', 1))).status).toBe(200);
    expect(after.workers.map((w) => w.participant.has('sess-1'))).toEqual([false, false]);
    // The worker tells the coordinator in a message of its own: wait for it, bounded.
    await until(async () => (await restoredPending(after)).length === 0, 'restored_pending empty');
  });
});

describe('agent workers: a commit writes what one process writes', () => {
  /** The records file of the agent's state under `checkpointDir`. */
  async function recordsFile(checkpointDir: string): Promise<Buffer> {
    const state = join(checkpointDir, 'gym', 'agent', 'simple_agent');
    const name = (await readdir(state)).find((f) => f.startsWith('records-'))!;
    return readFile(join(state, name));
  }

  test("the records file of a two-worker commit is byte for byte the one the workers' participants write alone", async () => {
    const s = await twoWorkers();
    const a = await seed(via(s, 0), 'a-1', 'r1');
    expect((await activate(via(s, 0), a, 'r1', 1)).status).toBe(200);
    await seed(via(s, 1), 'b-1', 'r2');
    const scope = [ep('r1'), ep('r2')];
    expect((await prepare(via(s), 'c1')).phase).toBe('prepared');
    expect(await commit(via(s), 'c1', scope)).toEqual(['r1', 'r2']);
    // One process's store, handed each worker's participant's own records, worker by worker.
    const signal = new AbortController().signal;
    const records = [];
    for (const w of s.workers) records.push(...(await w.participant.export(scope, signal)));
    const alone = join(dir, 'one-process');
    await writeParticipantState({
      checkpointDir: alone,
      kind: 'agent',
      instance: 'simple_agent',
      checkpointId: 'c1',
      records,
    });
    await resume(via(s), 'c1');
    expect(records.map((r) => r.session_key)).toEqual(['a-1', 'b-1']);
    const [workers, oneProcess] = [await recordsFile(join(dir, 'c1')), await recordsFile(alone)];
    expect(workers.toString()).toBe(oneProcess.toString());
    expect(workers.equals(oneProcess)).toBe(true);
  });
});

/** Prepare and commit `rollouts` (at `attempt`), then resume. */
async function commitAll(
  s: AgentWorkers,
  id: string,
  rollouts: string[],
  attempt = 0,
): Promise<string[]> {
  expect((await prepare(via(s), id)).phase).toBe('prepared');
  const committed = await commit(
    via(s),
    id,
    rollouts.map((r) => ep(r, attempt)),
  );
  await resume(via(s), id);
  return committed;
}
