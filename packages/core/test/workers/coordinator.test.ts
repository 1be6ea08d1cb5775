import express from 'express';
import got from 'got';

import { EncodedReply, installControlPlane, planeTarget } from '../../src/control/routes.js';
import { InvalidPhaseError } from '../../src/errors.js';
import { captureKey, episodeId } from '../../src/identity.js';
import type { JsonValue } from '../../src/json.js';
import { listen } from '../../src/server.js';
import type { WorkerInfo } from '../../src/workers/types.js';
import { eventually, now, startToy } from './toy.js';
import { onCleanup, refusedWith, useSockets } from './sockets.js';

useSockets();

const prepare = (id: string, seconds = 5) => ({ checkpoint_id: id, deadline_ts: now() + seconds });
const r1 = episodeId('r1', 0);

async function codeOf(p: Promise<unknown>): Promise<[string, string]> {
  const err = await refusedWith(p);
  return [err.code, err.detail];
}

describe('the coordinator: readiness from the workers', () => {
  test('every expected worker reported ready: prepared, and status lists each worker by pid', async () => {
    const toy = await startToy(2);
    await toy.worker(1);
    await toy.worker(2);
    expect((await toy.plane.prepare(prepare('c1'))).phase).toBe('prepared');
    expect(toy.plane.status()).toMatchObject({
      workers: [
        { index: 1, pid: process.pid, ready: true },
        { index: 2, pid: process.pid, ready: true },
      ],
      expected_workers: 2,
      lost_workers: 0,
    });
  });

  test("an idle server's report counts what its workers count, not the workers (as one process)", async () => {
    const toy = await startToy(2);
    await toy.worker(1);
    await toy.worker(2);
    const reply = await toy.plane.prepare(prepare('c1'));
    expect(reply.phase).toBe('prepared');
    expect(reply.report.counts).toEqual({});
  });

  test('a worker that has not reported blocks readiness', async () => {
    const toy = await startToy(2);
    await toy.worker(1);
    const reply = await toy.plane.prepare(prepare('c1', 0.5));
    expect(reply.phase).toBe('preparing');
    expect(reply.report.blockers).toContain('resources-workers-unreported:1');
  });

  test("a worker's in-flight work blocks until its ticket leaves, reported after the close", async () => {
    const toy = await startToy(2);
    const one = await toy.worker(1);
    await toy.worker(2);
    const ticket = one.side.gate.enter({ episode: r1 });
    const first = await toy.plane.prepare(prepare('c1', 0.5));
    expect([first.phase, first.report.blockers]).toEqual(['preparing', [captureKey(r1)]]);
    const second = toy.plane.prepare(prepare('c1'));
    setTimeout(() => one.side.gate.leave(ticket), 50);
    expect((await second).phase).toBe('prepared');
  });

  test('a report of an earlier generation is ignored', async () => {
    const toy = await startToy(1);
    const one = await toy.worker(1);
    one.side.gate.enter({ episode: r1 });
    await toy.plane.prepare(prepare('c1', 0.2));
    const clean = { gate: { ...one.side.gate.snapshot(), inFlight: 0, byKey: {} }, extra: {} };
    toy.coordinator.receiveReport(1, toy.coordinator.generation - 1, { seq: 1000, report: clean });
    expect(toy.coordinator.ready()).toBe(false);
    toy.coordinator.receiveReport(1, toy.coordinator.generation, { seq: 1000, report: clean });
    expect(toy.coordinator.ready()).toBe(true);
  });

  test('the newest report wins when reports arrive out of order', async () => {
    const toy = await startToy(1);
    const one = await toy.worker(1);
    const ticket = one.side.gate.enter({ episode: r1 });
    await toy.plane.prepare(prepare('c1', 0.2));
    const busy = { gate: one.side.gate.snapshot(), extra: {} };
    one.side.gate.leave(ticket);
    const clean = { gate: one.side.gate.snapshot(), extra: {} };
    const generation = toy.coordinator.generation;
    toy.coordinator.receiveReport(1, generation, { seq: 1001, report: clean });
    toy.coordinator.receiveReport(1, generation, { seq: 1000, report: busy });
    expect(toy.coordinator.ready()).toBe(true);
  });
});

describe('the coordinator: workers that join and leave', () => {
  test('a worker lost during a checkpoint blocks it, even once another worker joins in its place', async () => {
    const toy = await startToy(2);
    await toy.worker(1);
    const raw = await toy.rawWorker(2);
    expect((await toy.plane.prepare(prepare('c1'))).phase).toBe('prepared');
    raw.socket.destroy();
    await eventually(() => toy.coordinator.workers().length === 1);
    await toy.worker(3);
    await eventually(() => toy.coordinator.workers().every((w) => w.report !== null));
    expect(toy.coordinator.readiness().blockers).toEqual(['resources-worker-lost']);
    const commit = toy.plane.commit({
      checkpoint_id: 'c1',
      deadline_ts: now() + 5,
      checkpoint_dir: `${toy.checkpointRoot}/c1`,
      episode_ids: null,
      stop: false,
    });
    expect((await codeOf(commit))[0]).toBe('export_failed');
    const warning = toy.logger.lines.find((l) => l.level === 'warn');
    expect(warning?.message).toBe(
      'resources worker 2 was lost during checkpoint c1; it blocks that checkpoint from committing',
    );
  });

  test('a worker lost during a checkpoint is named in the status until admission reopens', async () => {
    const toy = await startToy(2);
    await toy.worker(1);
    const raw = await toy.rawWorker(2);
    expect((await toy.plane.prepare(prepare('c1'))).phase).toBe('prepared');
    expect(toy.plane.status()).toMatchObject({ lost_during_checkpoint: [] });
    raw.socket.destroy();
    await eventually(() => toy.coordinator.workers().length === 1);
    expect(toy.plane.status()).toMatchObject({
      lost_workers: 1,
      lost_during_checkpoint: [{ index: 2, pid: 90002 }],
    });
    await toy.coordinator.openAdmission();
    expect(toy.plane.status()).toMatchObject({ lost_workers: 1, lost_during_checkpoint: [] });
  });

  test('each lost worker is told to the loss listener, marked when during a checkpoint; a clean stop is not', async () => {
    const toy = await startToy(3);
    const losses: unknown[] = [];
    toy.coordinator.onWorkerLost((loss) => losses.push(loss));
    const one = await toy.worker(1);
    const idle = await toy.rawWorker(2);
    const busy = await toy.rawWorker(3);
    await one.link.detach();
    idle.socket.destroy();
    await eventually(() => toy.coordinator.workers().length === 1);
    await toy.plane.prepare(prepare('c1', 0.2));
    busy.socket.destroy();
    await eventually(() => toy.coordinator.workers().length === 0);
    expect(losses).toEqual([
      { index: 2, pid: 90002, duringCheckpoint: false },
      { index: 3, pid: 90003, duringCheckpoint: true },
    ]);
  });

  test('a late joiner adopts closed admission, the generation and the retired marks, and reports', async () => {
    const toy = await startToy(1);
    await toy.worker(1);
    const retired = episodeId('r9', 2);
    await toy.plane.retire({
      checkpoint_id: 'r-1',
      deadline_ts: now() + 5,
      episode_ids: [retired],
    });
    expect((await toy.plane.prepare(prepare('c1'))).phase).toBe('prepared');
    const late = await toy.worker(2);
    expect(late.side.gate.isOpen).toBe(false);
    expect(late.side.marks.isRetired(episodeId('r9', 1))).toBe(true);
    await eventually(() => toy.coordinator.workers().every((w) => w.report !== null));
    expect(toy.coordinator.ready()).toBe(true);
  });

  test('workers are logged by pid as they join; a clean stop is not reported as lost, a dropped one is a warning', async () => {
    const toy = await startToy(2);
    const one = await toy.worker(1);
    const raw = await toy.rawWorker(2);
    expect(toy.logger.lines.filter((l) => l.message.endsWith('joined')).map((l) => l.meta)).toEqual(
      [
        expect.objectContaining({ worker: 1, pid: process.pid }),
        expect.objectContaining({ worker: 2, pid: 90002 }),
      ],
    );
    await one.link.detach();
    await eventually(() => toy.coordinator.workers().length === 1);
    expect(toy.logger.lines.filter((l) => l.level === 'warn')).toEqual([]);
    expect(toy.logger.lines.map((l) => l.message)).toContain('resources worker 1 stopped');
    expect(toy.plane.status()).toMatchObject({ lost_workers: 0 });
    raw.socket.destroy();
    await eventually(() => toy.coordinator.workers().length === 0);
    const warnings = toy.logger.lines.filter((l) => l.level === 'warn');
    expect(warnings.map((l) => [l.message, l.meta.pid])).toEqual([
      ['resources worker 2 was lost', 90002],
    ]);
    expect(toy.plane.status()).toMatchObject({ lost_workers: 1 });
  });

  test('a worker that loses its coordinator stops itself', async () => {
    const toy = await startToy(1);
    const one = await toy.worker(1);
    expect(one.lost.value).toBe(false);
    await toy.server.close();
    await eventually(() => one.lost.value);
  });
});

describe('the coordinator: retire, forget and failures', () => {
  test('retire marks the attempt on every worker before any worker stops its calls', async () => {
    const toy = await startToy(2);
    let markAnswered = false;
    const seen: boolean[] = [];
    await toy.worker(1, {
      retire: async () => {
        seen.push(markAnswered);
      },
    });
    // Worker 2 answers its mark late: worker 1 must not be told to retire before it has.
    await toy.rawWorker(2, async (kind) => {
      if (kind !== 'mark') return;
      await new Promise((resolve) => setTimeout(resolve, 200));
      markAnswered = true;
    });
    await toy.plane.retire({ checkpoint_id: 'r-1', deadline_ts: now() + 5, episode_ids: [r1] });
    expect(seen).toEqual([true]);
  });

  test('forget is relayed: every worker stops refusing the rollout', async () => {
    const toy = await startToy(2);
    const one = await toy.worker(1);
    const two = await toy.worker(2);
    await toy.plane.retire({ checkpoint_id: 'r-1', deadline_ts: now() + 5, episode_ids: [r1] });
    expect([one.side.marks.isRetired(r1), two.side.marks.isRetired(r1)]).toEqual([true, true]);
    await toy.plane.forget({ checkpoint_id: 'r-1', deadline_ts: now() + 5, rollout_ids: ['r1'] });
    await eventually(() => !one.side.marks.isRetired(r1) && !two.side.marks.isRetired(r1));
  });

  test("a worker failing a close fails the prepare with that worker's code, and admission reopens everywhere", async () => {
    const toy = await startToy(2);
    const one = await toy.worker(1);
    const two = await toy.worker(2, {
      close: () => Promise.reject(new InvalidPhaseError('not now')),
    });
    const [code, detail] = await codeOf(toy.plane.prepare(prepare('c1')));
    expect([code, detail]).toEqual([
      'invalid_phase',
      'resources worker 2 did not complete close: not now',
    ]);
    await eventually(() => one.side.gate.isOpen && two.side.gate.isOpen);
    expect(toy.coordinator.accepting).toBe(true);
  });

  test('a restore whose close of admission fails on one worker reopens admission on every worker', async () => {
    const toy = await startToy(2);
    let failClose = false;
    const one = await toy.worker(1);
    await toy.worker(2, {
      close: async () => {
        if (failClose) throw new Error('worker 2 cannot close');
      },
    });
    const dir = `${toy.checkpointRoot}/c1`;
    expect((await toy.plane.prepare(prepare('c1'))).phase).toBe('prepared');
    const deadline = now() + 5;
    await toy.plane.commit({
      checkpoint_id: 'c1',
      deadline_ts: deadline,
      checkpoint_dir: dir,
      episode_ids: null,
      stop: false,
    });
    await toy.plane.resume({ checkpoint_id: 'c1', deadline_ts: now() + 5 });
    failClose = true;
    const restore = toy.plane.restore({
      checkpoint_id: 'c2',
      deadline_ts: now() + 5,
      checkpoint_dir: dir,
      episode_ids: [],
    });
    expect((await codeOf(restore))[0]).toBe('checkpoint_error');
    await eventually(() => one.side.gate.isOpen && toy.coordinator.accepting);
  });
});

describe('control calls forwarded by a worker', () => {
  test('a control call on a worker gets exactly what the coordinator plane replies: status code and JSON body', async () => {
    const toy = await startToy(1);
    const one = await toy.worker(1);
    const direct = express();
    installControlPlane(direct, planeTarget(toy.plane), 'secret');
    const viaWorker = express();
    installControlPlane(viaWorker, one.link.controlTarget(), 'secret');
    const servers = [await listen(direct, 0, '127.0.0.1'), await listen(viaWorker, 0, '127.0.0.1')];
    onCleanup(async () => {
      for (const s of servers) await s.close();
    });
    const ask = async (url: string, path: string, json?: unknown) => {
      const res = await got(`${url}/ng-control/v1/checkpoint/${path}`, {
        method: json === undefined ? 'GET' : 'POST',
        headers: { authorization: 'Bearer secret' },
        ...(json === undefined ? {} : { json }),
        throwHttpErrors: false,
      });
      return [
        res.statusCode,
        JSON.parse(res.body) as unknown,
        res.headers['x-should-retry'],
        res.headers['content-type'],
        res.body,
      ];
    };
    const calls: [string, unknown?][] = [
      ['status'],
      ['prepare', { checkpoint_id: 'c1' }],
      ['renew', { checkpoint_id: 'c1', deadline_ts: now() + 5 }],
      ['resume', { checkpoint_id: 'never-opened', deadline_ts: now() + 5 }],
    ];
    for (const [path, body] of calls) {
      const [a, b] = [
        await ask(servers[0]!.url, path, body),
        await ask(servers[1]!.url, path, body),
      ];
      expect([path, b]).toEqual([path, a]);
    }
    // The worker forwarded them: a refused call is not answered by any plane of its own.
    expect(
      (await ask(servers[1]!.url, 'renew', { checkpoint_id: 'c1', deadline_ts: now() + 5 }))[0],
    ).toBe(409);
  });

  test("a route's reply reaches the worker as the coordinator's JSON text, which it sends as it came", async () => {
    const toy = await startToy(1);
    const one = await toy.worker(1);
    const signal = new AbortController().signal;
    const reply = await one.link
      .controlTarget()
      .call('prepare', { checkpoint_id: 'c1', deadline_ts: now() + 5 }, signal);
    expect(reply).toBeInstanceOf(EncodedReply);
    const direct = await planeTarget(toy.plane).call(
      'prepare',
      { checkpoint_id: 'c1', deadline_ts: now() + 5 },
      signal,
    );
    expect(Buffer.from((reply as EncodedReply).json).toString('utf8')).toBe(JSON.stringify(direct));
  });
});

describe('kind hooks', () => {
  test("a kind's join state reaches the worker's adopt, its messages reach handle, and handleNow serves before the read loop goes on", async () => {
    const toy = await startToy(1);
    const claims = new Set(['r1#0']);
    Object.assign(toy.coordinator, {
      joinState: (w: WorkerInfo) => ({ greeting: `hello ${w.index}` }),
      handle: async (w: WorkerInfo, kind: string, body: JsonValue) => ({
        from: w.index,
        kind,
        body,
      }),
      handleNow: (_w: WorkerInfo, kind: string, body: JsonValue) =>
        kind === 'claim' ? { won: claims.delete((body as { key: string }).key) } : undefined,
    });
    const adopted: unknown[] = [];
    const one = await toy.worker(1, { adopt: (state) => void adopted.push(state) });
    expect(adopted).toEqual([{ greeting: 'hello 1' }]);
    expect(await one.link.call('ping', { n: 1 })).toEqual({
      from: 1,
      kind: 'ping',
      body: { n: 1 },
    });
    const [first, second] = await Promise.all([
      one.link.call('claim', { key: 'r1#0' }),
      one.link.call('claim', { key: 'r1#0' }),
    ]);
    expect([first, second]).toEqual([{ won: true }, { won: false }]);
  });
});
