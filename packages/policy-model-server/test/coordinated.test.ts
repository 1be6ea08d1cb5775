/**
 * A policy model server with several workers, in one test process: the policy coordinator and its
 * control plane on a Unix socket (core's coordinator server), and each worker's app with its own
 * gate, linked to it by core's worker link and listening on its own port.
 */
import { existsSync } from 'node:fs';
import { join } from 'node:path';

import { afterEach, describe, expect, it } from '@jest/globals';
import {
  captureKey,
  CoordinatorUnavailableError,
  type JsonObject,
  type JsonValue,
} from '@ckpt-gym/core/protocol';
import {
  ControlPlane,
  createRuntimeDir,
  type ListeningServer,
  listen,
  parseStackFile,
  planeTarget,
  readParticipantState,
  serveCoordinator,
  serverSettings,
  WithBytes,
  WorkerLink,
  writeParticipantState,
} from '@ckpt-gym/core/server';
import { closeNow, ep, until } from '@ckpt-gym/testing';

import { createPolicyModelServer, type PolicyModelServer } from '../src/index.js';
import { type PolicyCoordinator } from '../src/coordinator.js';
import type { CutRecord } from '../src/cuts.js';
import { policyModelKind } from '../src/kind.js';
import { CaptureLedger, STARTED_SUFFIX } from '../src/ledger.js';
import { stagingKeysReply, validateModelRecord } from '../src/participant.js';
import type { PolicyWorkerSnapshot } from '../src/worker-rules.js';

import {
  chat,
  CUT_RECORD,
  cleanup,
  control,
  fakeCalls,
  startFake,
  stackYaml,
  silentLogger,
  tempDir,
} from './support.js';

afterEach(cleanup);

const cleanups: (() => Promise<void>)[] = [];
afterEach(async () => {
  while (cleanups.length > 0) await cleanups.pop()!();
});

interface Worker {
  readonly model: PolicyModelServer;
  readonly link: WorkerLink;
  readonly listening: ListeningServer;
  readonly url: string;
}

interface Coordinated {
  readonly coordinator: PolicyCoordinator;
  readonly captureDir: string;
  readonly plane: ControlPlane<never>;
  readonly workers: Worker[];
  /** Starts (and links) worker `index`, as the primary forks one. */
  startWorker(index: number): Promise<Worker>;
}

const deadlineTs = () => Date.now() / 1000 + 30;

async function startCoordinated(workers = 2, start = workers, extra = ''): Promise<Coordinated> {
  const fake = await startFake();
  const captureDir = await tempDir();
  const stack = parseStackFile(
    stackYaml(`${fake.url}/v1`, captureDir, { extra: `, num_workers: ${workers}${extra}` }),
  );
  const logger = silentLogger();
  const coordinator = policyModelKind.workers!.coordinator(stack, 'policy', {
    expectedWorkers: workers,
    logger,
  }) as PolicyCoordinator;
  const plane = new ControlPlane(coordinator, { leaseGraceSeconds: 600, logger });
  const dir = createRuntimeDir();
  const socketPath = join(dir.path, 'coordinator.sock');
  const server = await serveCoordinator(coordinator, planeTarget(plane), socketPath, logger);
  cleanups.push(async () => {
    plane.dispose();
    await server.close();
    dir.remove();
  });
  const settings = serverSettings(stack, 'policy');
  const started: Worker[] = [];
  const startWorker = async (index: number): Promise<Worker> => {
    const link = new WorkerLink({ socketPath, index, logger, onCoordinatorLost: () => undefined });
    const model = await createPolicyModelServer(settings, stack, { logger, link });
    await link.attach(model.worker!);
    const listening = await listen(model.app, 0);
    cleanups.push(async () => {
      await closeNow(listening);
      await link.detach();
    });
    const worker = { model, link, listening, url: listening.url };
    started.push(worker);
    return worker;
  };
  for (let index = 1; index <= start; index++) await startWorker(index);
  return {
    coordinator,
    captureDir,
    plane: plane as unknown as ControlPlane<never>,
    workers: started,
    startWorker,
  };
}

/** The ledger keys each worker hands, by message (`presnapshot`, `snapshot`) and worker. */
function handedKeys(c: Coordinated): Record<'presnapshot' | 'snapshot', Map<number, string[]>> {
  const handed = {
    presnapshot: new Map<number, string[]>(),
    snapshot: new Map<number, string[]>(),
  };
  for (const [i, worker] of c.workers.entries()) {
    const handle = worker.model.worker!.handle.bind(worker.model.worker);
    worker.model.worker!.handle = async (kind: string, body?: JsonValue) => {
      const reply = await handle(kind, body);
      const { ledgers } = reply.body as unknown as PolicyWorkerSnapshot;
      handed[kind as 'snapshot' | 'presnapshot'].set(i, [...ledgers!.keys]);
      return reply;
    };
  }
  return handed;
}

async function prepared(c: Coordinated, id: string): Promise<void> {
  const reply = await c.plane.prepare({ checkpoint_id: id, deadline_ts: deadlineTs() });
  expect(reply.phase).toBe('prepared');
}

describe('the commit of several workers', () => {
  it('a worker lost after readiness and before its snapshot fails the commit with export_failed, and a retried commit fails the same way', async () => {
    const c = await startCoordinated();
    const [, second] = c.workers;
    await prepared(c, 'c1');
    // The second worker's snapshot is slow: the worker is lost while the coordinator collects.
    let release!: () => void;
    const slow = new Promise<void>((resolve) => (release = resolve));
    const snapshot = second!.model.worker!.handle.bind(second!.model.worker);
    let asked = false;
    second!.model.worker!.handle = async (kind: string, body?: JsonValue) => {
      if (kind !== 'snapshot') return snapshot(kind, body);
      asked = true;
      await slow;
      return snapshot(kind, body);
    };
    const dir = await tempDir();
    const commit = () =>
      control(second!.url, 'commit', {
        checkpoint_id: 'c1',
        checkpoint_dir: dir,
        episode_ids: [{ rollout_id: 'r', attempt: 0 }],
        deadline_ts: deadlineTs(),
      });
    const first = commit();
    await until(async () => asked, 'the snapshot to be asked for');
    // As the coordinator's socket server reports a connection that dropped.
    c.coordinator.left(2);
    release();
    const reply = await first;
    expect(reply.status).toBe(409);
    expect(reply.body).toMatchObject({ error: { code: 'export_failed' } });
    expect(JSON.stringify(reply.body)).toMatch(/lost after admission closed/);
    const retried = await control(c.workers[0]!.url, 'commit', {
      checkpoint_id: 'c1',
      checkpoint_dir: dir,
      episode_ids: [{ rollout_id: 'r', attempt: 0 }],
      deadline_ts: deadlineTs(),
    });
    expect(retried.body).toMatchObject({ error: { code: 'export_failed' } });
  });

  it('refuses an export when fewer workers answer the snapshot than expected', async () => {
    // The second worker never joined (the controller's readiness wait would block on it).
    const c = await startCoordinated(2, 1);
    await c.coordinator.closeAdmission({
      checkpointId: 'c1',
      deadlineTs: deadlineTs(),
      carriedRestarts: new Set(),
    });
    await expect(c.coordinator.export([ep('r')], new AbortController().signal)).rejects.toThrow(
      /only 1 of 2 policy workers answered/,
    );
  });

  it('refuses an export after a worker left while admission was closed', async () => {
    const c = await startCoordinated();
    await prepared(c, 'c1');
    await c.workers[1]!.link.detach();
    await until(async () => c.coordinator.workers().length === 1, 'the worker to leave');
    await expect(c.coordinator.export([ep('r')], new AbortController().signal)).rejects.toThrow(
      /lost after admission closed/,
    );
  });
});

describe("the commit's handed ledgers", () => {
  it('each worker hands the in-scope ledgers it appended as bytes; one another server changed since, or no worker knows, is read from disk', async () => {
    const c = await startCoordinated();
    const [first, second] = c.workers;
    expect((await chat(first!.url, 'r-a1')).status).toBe(200);
    expect((await chat(second!.url, 's-a1')).status).toBe(200);
    expect((await chat(first!.url, 't-a1')).status).toBe(200);
    expect((await chat(first!.url, 'out-a1')).status).toBe(200);
    // Another server sharing the directory appends to t-a1 after the worker knew it, and writes
    // u-a1, which no worker knows.
    const other = await new CaptureLedger(c.captureDir).init();
    await other.append('t-a1', { model_call_id: 'elsewhere', staging_key: 'st' });
    await other.append('u-a1', { model_call_id: 'u1', logprob: -Infinity, staging_key: 'su' });
    const handed = handedKeys(c);
    await prepared(c, 'c1');
    await until(async () => handed.presnapshot.size === 2, 'both pre-snapshots');
    const scope = [ep('r', 1), ep('s', 1), ep('t', 1), ep('u', 1), ep('none', 1)];
    const records = await c.coordinator.export(scope, new AbortController().signal);
    // Every ledger each appended crossed, as it knew it, once the coordinator was ready; the
    // commit's snapshots hand nothing again, and t-a1, changed by the other server, is read.
    const pre = Object.fromEntries(handed.presnapshot);
    expect(pre).toEqual({ 0: ['r-a1', 't-a1', 'out-a1'], 1: ['s-a1'] });
    expect(Object.fromEntries(handed.snapshot)).toEqual({ 0: [], 1: [] });
    const keys = ['r-a1', 's-a1', 't-a1', 'u-a1'];
    const onDisk = await new CaptureLedger(c.captureDir).exportMany(keys);
    expect(records.map((r) => captureKey(r.episode_id))).toEqual(keys);
    expect(records.map((r) => r.rows)).toEqual(onDisk.map((l) => l.rows));
    expect(onDisk[2]!.rows).toHaveLength(2);
    // The bytes written are the rows' records: read back, they are the ledgers' rows.
    const state = { checkpointDir: await tempDir(), kind: 'model', instance: 'policy' };
    await writeParticipantState({ ...state, checkpointId: 'c1', records });
    const { records: read } = await readParticipantState({
      ...state,
      select: () => true,
      validate: validateModelRecord,
    });
    expect(read.map((r) => r.rows)).toEqual(onDisk.map((l) => l.rows));
    expect(stagingKeysReply(records)).toEqual(stagingKeysReply(read));
    expect(stagingKeysReply(records).staging_keys).toContain('su');
  });

  it('a ledger changed after the pre-snapshot is exported as it is at commit: appended by the worker, handed again; changed by another server, read from disk', async () => {
    const c = await startCoordinated();
    const [first, second] = c.workers;
    for (const key of ['r-a1', 's-a1']) expect((await chat(first!.url, key)).status).toBe(200);
    expect((await chat(second!.url, 't-a1')).status).toBe(200);
    const handed = handedKeys(c);
    await prepared(c, 'c1');
    await until(async () => handed.presnapshot.size === 2, 'both pre-snapshots');
    await first!.model.ledger!.append('r-a1', { model_call_id: 'late', staging_key: 'sl' });
    const other = await new CaptureLedger(c.captureDir).init();
    await other.append('t-a1', { model_call_id: 'elsewhere', staging_key: 'se' });
    const scope = [ep('r', 1), ep('s', 1), ep('t', 1)];
    const records = await c.coordinator.export(scope, new AbortController().signal);
    expect(Object.fromEntries(handed.snapshot)).toEqual({ 0: ['r-a1'], 1: [] });
    const keys = ['r-a1', 's-a1', 't-a1'];
    const onDisk = await new CaptureLedger(c.captureDir).exportMany(keys);
    expect(records.map((r) => r.rows)).toEqual(onDisk.map((l) => l.rows));
    expect(onDisk.map((l) => l.rows.length)).toEqual([2, 1, 2]);
  });

  it("a row one worker handed is left out when another worker's snapshot has its call undelivered", async () => {
    const c = await startCoordinated();
    const [first, second] = c.workers;
    expect((await chat(first!.url, 'r-a1')).status).toBe(200);
    expect((await chat(first!.url, 's-a1')).status).toBe(200);
    const [r] = await new CaptureLedger(c.captureDir).exportMany(['r-a1']);
    await prepared(c, 'c1');
    const handle = second!.model.worker!.handle.bind(second!.model.worker);
    second!.model.worker!.handle = async (kind: string, body?: JsonValue) => {
      const reply = await handle(kind, body);
      const snapshot = reply.body as unknown as PolicyWorkerSnapshot;
      const undelivered = [...snapshot.undelivered, String(r!.rows[0]!.model_call_id)];
      return new WithBytes({ ...snapshot, undelivered } as unknown as JsonValue, reply.bytes);
    };
    const records = await c.coordinator.export(
      [ep('r', 1), ep('s', 1)],
      new AbortController().signal,
    );
    expect(records.map((record) => captureKey(record.episode_id))).toEqual(['s-a1']);
  });

  it("a worker's snapshot is its JSON with its ledgers' bytes beside it", async () => {
    const c = await startCoordinated();
    expect((await chat(c.workers[0]!.url, 'r-a1')).status).toBe(200);
    await prepared(c, 'c1');
    const reply = await c.workers[0]!.model.worker!.handle('snapshot', { keys: ['r-a1'] });
    expect(reply).toBeInstanceOf(WithBytes);
    const [ledger] = await new CaptureLedger(c.captureDir).exportMany(['r-a1']);
    expect(Buffer.from(reply.bytes).toString('utf8')).toBe(ledger!.lines.join(','));
  });
});

describe('restored attempts across workers', () => {
  it('an attempt any worker started is no longer pending, marked started in the shared ledger, and a reopen does not make it pending again', async () => {
    const c = await startCoordinated();
    await c.coordinator.closeAdmission({
      checkpointId: 'r1',
      deadlineTs: deadlineTs(),
      carriedRestarts: new Set(),
    });
    await c.coordinator.install([], [ep('r'), ep('s')]);
    await c.coordinator.openAdmission();
    expect(c.coordinator.restoredPending().map(captureKey)).toEqual(['r-a1', 's-a1']);

    expect((await chat(c.workers[1]!.url, 'r-a1')).status).toBe(200);
    await until(
      async () => c.coordinator.restoredPending().length === 1,
      'the started attempt to leave the pending ones',
    );
    expect(c.coordinator.restoredPending().map(captureKey)).toEqual(['s-a1']);
    expect(existsSync(join(c.captureDir, `r-a1${STARTED_SUFFIX}`))).toBe(true);

    // A checkpoint opens and resumes: the reopen hands the workers nothing.
    await prepared(c, 'c1');
    await c.plane.resume({ checkpoint_id: 'c1', deadline_ts: deadlineTs() });
    expect(c.coordinator.restoredPending().map(captureKey)).toEqual(['s-a1']);
    expect((await chat(c.workers[0]!.url, 's-a1')).status).toBe(200);
    await until(async () => c.coordinator.restoredPending().length === 0, 'no attempt pending');
  });
});

describe('restored cuts across workers', () => {
  it('a restored cut is claimed once across workers (over their channels)', async () => {
    const c = await startCoordinated(2, 2, ', checkpoint_generation_cuts: true');
    const cut = CUT_RECORD;
    await c.coordinator.install(
      [{ episode_id: ep('r'), rows: [], generation_cuts: [cut as unknown as JsonObject] }],
      [ep('r')],
    );
    expect(c.coordinator.statusExtra().restored_generation_cuts).toEqual(['r-a1']);
    const claims = await Promise.all(
      c.workers.map((w) => w.link.call('claim_cut', { capture_key: 'r-a1' })),
    );
    const records = claims.map((reply) => (reply as { record: unknown }).record);
    expect(records.filter((r) => r !== null)).toEqual([cut]);
    expect(c.coordinator.statusExtra().restored_generation_cuts).toEqual([]);
  });
});

describe('restore with several workers', () => {
  const restoreBody = async () => ({
    checkpoint_id: 'r1',
    checkpoint_dir: await tempDir(),
    episode_ids: [{ rollout_id: 'r', attempt: 0 }],
    deadline_ts: deadlineTs(),
  });

  it('is refused once any worker served a call', async () => {
    const c = await startCoordinated();
    expect((await chat(c.workers[1]!.url, 'r')).status).toBe(200);
    await until(
      async () => (c.coordinator.statusExtra().served as boolean) === true,
      'the worker to say it served',
    );
    const reply = await control(c.workers[0]!.url, 'restore', await restoreBody());
    expect(reply.status).toBe(409);
    expect(JSON.stringify(reply.body)).toMatch(/a worker has served calls/);
  });

  it('is refused after a worker left, even if its replacement is fresh', async () => {
    const c = await startCoordinated();
    await c.workers[1]!.link.detach();
    await until(async () => c.coordinator.workers().length === 1, 'the worker to leave');
    const replacement = await c.startWorker(2);
    expect(
      c.coordinator
        .workers()
        .map((w) => w.index)
        .sort(),
    ).toEqual([1, 2]);
    const reply = await control(replacement.url, 'restore', await restoreBody());
    expect(reply.status).toBe(409);
    expect(JSON.stringify(reply.body)).toMatch(/a worker has left since start/);
  });
});

/** A link to a coordinator that hands out one restored cut and cannot take it back. */
class OneCutLink {
  readonly sent: string[] = [];
  constructor(private readonly record: CutRecord) {}

  call(kind: string, _body: JsonValue): Promise<JsonValue> {
    this.sent.push(kind);
    if (kind === 'claim_cut') return Promise.resolve({ record: this.record as never });
    if (kind === 'return_cut') throw new CoordinatorUnavailableError('the coordinator went away');
    return Promise.resolve({});
  }

  controlTarget() {
    return new WorkerLink({
      socketPath: '/nonexistent',
      index: 1,
      logger: silentLogger(),
    }).controlTarget();
  }
}

describe("a worker's restored cuts", () => {
  const CUTS = ', checkpoint_generation_cuts: true, num_workers: 2';

  async function worker(link: unknown) {
    const fake = await startFake();
    const stack = parseStackFile(stackYaml(`${fake.url}/v1`, await tempDir(), { extra: CUTS }));
    const model = await createPolicyModelServer(serverSettings(stack, 'policy'), stack, {
      logger: silentLogger(),
      link: link as WorkerLink,
    });
    const listening = await listen(model.app, 0);
    cleanups.push(() => closeNow(listening));
    model.worker!.adopt({ restored_keys: ['r-a1'], restored_targets: [] });
    return { fake, model, url: listening.url };
  }

  it('a claim against an unavailable coordinator falls back to regenerating', async () => {
    // A link that never reached its coordinator: every message is `checkpoint_coordinator_unavailable`.
    const link = new WorkerLink({ socketPath: '/nonexistent', index: 1, logger: silentLogger() });
    const { fake, url } = await worker(link);
    const reply = await chat(url, 'r-a1');
    expect(reply.status).toBe(200);
    const [call] = await fakeCalls(fake);
    expect((call!.admission as { generation_cut: unknown }).generation_cut).toBeNull();
  });

  it("a ticket's exit is reported even if giving back its unused cut fails", async () => {
    const record = {
      capture_key: 'r',
      model_call_id: 'c0',
      request_digest: 'another conversation',
      admitted_at: 1,
      cut_id: 'cut',
      continuation: {},
    } as unknown as CutRecord;
    const link = new OneCutLink(record);
    const { model, url } = await worker(link);
    expect((await chat(url, 'r-a1')).status).toBe(200);
    await until(async () => link.sent.includes('return_cut'), 'the cut to be given back');
    expect(model.gate.inflight).toBe(0);
  });
});
