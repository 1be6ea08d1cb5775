/**
 * A server with several workers as real processes: the fixture's toy kind started through
 * `startServer` under node cluster (transpiled sources, not dist/).
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { once } from 'node:events';
import { mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { request } from 'node:http';
import { join } from 'node:path';

import { pidAlive } from '../../src/workers/runtime-dir.js';
import { removeTranspiled, transpileCore } from '../support/transpile.js';

const FIXTURE = join(import.meta.dirname, '..', 'fixtures', 'toy-workers-server.mjs');
const TOKEN = 'tok';
let core = '';
let dir = '';
const children: ChildProcess[] = [];

beforeAll(async () => {
  core = await transpileCore();
  dir = mkdtempSync('/tmp/cgt-');
  writeFileSync(
    join(dir, 'stack.yaml'),
    [
      `checkpoint: { enabled: true, control_auth_token: ${TOKEN} }`,
      'servers:',
      '  toy: { kind: resources, app: toy, port: 0 }',
    ].join('\n'),
  );
}, 120_000);
afterAll(async () => {
  for (const child of children) if (child.exitCode === null) child.kill('SIGKILL');
  await removeTranspiled(core);
  rmSync(dir, { recursive: true, force: true });
});

interface Running {
  readonly child: ChildProcess;
  readonly port: number;
  /** Every JSON line of stdout (logs, the listening line) and stderr (worker exits). */
  readonly lines: Record<string, unknown>[];
}

function collect(stream: NodeJS.ReadableStream, lines: Record<string, unknown>[]): void {
  let rest = '';
  stream.on('data', (chunk: Buffer) => {
    const parts = (rest + chunk.toString('utf8')).split('\n');
    rest = parts.pop()!;
    for (const part of parts) if (part.startsWith('{')) lines.push(JSON.parse(part) as never);
  });
}

/** Resolves once `predicate` holds, looked at every 50 ms; rejects after `limitMs`. */
async function until(predicate: () => boolean, limitMs = 60_000): Promise<void> {
  const end = Date.now() + limitMs;
  while (!predicate()) {
    if (Date.now() > end) throw new Error('the condition never held');
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

async function start(workers: number): Promise<Running> {
  const child = spawn(process.execPath, [FIXTURE, core, join(dir, 'stack.yaml'), `${workers}`], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, CKPT_GYM_LOG_LEVEL: 'info' },
  });
  children.push(child);
  const lines: Record<string, unknown>[] = [];
  collect(child.stdout!, lines);
  collect(child.stderr!, lines);
  await until(() => lines.some((l) => l.event === 'listening') || child.exitCode !== null);
  const listening = lines.find((l) => l.event === 'listening');
  if (!listening) throw new Error(`the server exited: ${JSON.stringify(lines)}`);
  return { child, port: listening.port as number, lines };
}

/** The JSON bodies this test reads (whoami, status, control replies). */
interface Body {
  pid?: number;
  phase?: string;
  error?: { code: string };
  workers?: { index: number; pid: number; ready: boolean }[];
  expected_workers?: number;
  lost_workers?: number;
  report?: { blockers: string[] };
  lost_during_checkpoint?: { index: number; pid: number }[];
}

/** One HTTP call on a fresh connection (so cluster may hand it to any worker). */
function call(port: number, method: string, path: string, body?: unknown): Promise<[number, Body]> {
  return new Promise((resolve, reject) => {
    const req = request(
      {
        host: '127.0.0.1',
        port,
        method,
        path,
        agent: false,
        headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
      },
      (res) => {
        let text = '';
        res.on('data', (c: Buffer) => (text += c.toString('utf8')));
        res.on('end', () => resolve([res.statusCode!, JSON.parse(text) as Body]));
      },
    );
    req.on('error', reject);
    req.end(body === undefined ? undefined : JSON.stringify(body));
  });
}

const control = (port: number, route: string, body?: unknown) =>
  call(port, body === undefined ? 'GET' : 'POST', `/ng-control/v1/checkpoint/${route}`, body);
const deadline = () => Date.now() / 1000 + 20;

/** Polls status until `predicate` holds; rejects after a minute. */
async function statusWhen(port: number, predicate: (status: Body) => boolean): Promise<Body> {
  const end = Date.now() + 60_000;
  for (;;) {
    const [, status] = await control(port, 'status');
    if (predicate(status)) return status;
    if (Date.now() > end) throw new Error(`status never matched: ${JSON.stringify(status)}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

/** GET /metrics on a fresh connection (so cluster may hand it to any worker): its text. */
function scrapeOnce(port: number): Promise<string> {
  return new Promise((resolve, reject) => {
    const req = request({ host: '127.0.0.1', port, path: '/metrics', agent: false }, (res) => {
      let text = '';
      res.on('data', (c: Buffer) => (text += c.toString('utf8')));
      res.on('end', () => resolve(text));
    });
    // A connection cluster hands to a worker that just died is never answered: ask again.
    req.setTimeout(5_000, () => req.destroy(new Error('no answer')));
    req.on('error', reject);
    req.end();
  });
}

async function scrape(port: number): Promise<string> {
  for (let attempt = 1; ; attempt += 1) {
    try {
      return await scrapeOnce(port);
    } catch (err) {
      if (attempt === 5) throw err;
    }
  }
}

/** The value of the one sample of `metric` whose labels start with `labels` (undefined if none). */
function sample(text: string, metric: string, labels: string): number | undefined {
  const line = text.split('\n').find((l) => l.startsWith(`${metric}{${labels},`));
  return line === undefined ? undefined : Number(line.slice(line.lastIndexOf(' ') + 1));
}

function runtimeDirsOf(pid: number): string[] {
  return readdirSync('/tmp').filter((name) => name.startsWith(`cg-${pid}-`));
}

describe('a server with two worker processes', () => {
  test('both workers serve the one port and the primary prints one listening line; a worker SIGKILLed during a checkpoint blocks its commit; SIGTERM stops all and exits 0', async () => {
    const { child, port, lines } = await start(2);
    expect(runtimeDirsOf(child.pid!)).toHaveLength(1);
    const pids = new Set<number>();
    for (let i = 0; i < 40 && pids.size < 2; i += 1)
      pids.add((await call(port, 'GET', '/whoami'))[1].pid!);
    expect(pids.size).toBe(2);
    expect(pids.has(child.pid!)).toBe(false);

    const [, status] = await control(port, 'status');
    expect(status).toMatchObject({ expected_workers: 2, lost_workers: 0 });
    expect(new Set(status.workers!.map((w) => w.pid))).toEqual(pids);
    const prepared = await control(port, 'prepare', {
      checkpoint_id: 'c1',
      deadline_ts: deadline(),
    });
    expect(prepared).toEqual([200, expect.objectContaining({ phase: 'prepared' })]);

    const victim = status.workers!.find((w) => w.index === 2)!.pid;
    process.kill(victim, 'SIGKILL');
    await until(() => !pidAlive(victim));
    const after = await statusWhen(port, (s) => s.lost_workers === 1);
    expect(after.report!.blockers).toContain('resources-worker-lost');
    const commit = await control(port, 'commit', {
      checkpoint_id: 'c1',
      deadline_ts: deadline(),
      checkpoint_dir: join(dir, 'c1'),
      episode_ids: null,
      stop: false,
    });
    expect([commit[0], commit[1].error?.code]).toEqual([409, 'export_failed']);
    expect(lines.filter((l) => l.level === 'warn').map((l) => l.message)).toContain(
      'resources worker 2 was lost during checkpoint c1; it blocks that checkpoint from committing',
    );

    child.kill('SIGTERM');
    const [code] = (await once(child, 'exit')) as [number | null];
    expect(code).toBe(0);
    expect([...pids].filter(pidAlive)).toEqual([]);
    expect(lines.filter((l) => l.event === 'worker_exit')).toEqual([
      { event: 'worker_exit', index: 1, code: 0 },
    ]);
    expect(lines.filter((l) => l.event === 'listening')).toHaveLength(1);
    expect(runtimeDirsOf(child.pid!)).toEqual([]);
    expect(
      lines.filter((l) => l.level === 'warn' && String(l.message).includes('worker 1')),
    ).toEqual([]);
  }, 180_000);

  test("a scrape of any worker has the coordinator's series: the worker lost during a checkpoint, the plane's operations", async () => {
    const { child, port } = await start(2);
    const [, status] = await control(port, 'status');
    const events = 'gym_checkpoint_events_total';
    const prepares = 'gym_checkpoint_operation_duration_ms_count';
    const before = await scrape(port);
    expect(sample(before, events, 'event="worker_lost"')).toBe(0);
    expect(sample(before, events, 'event="worker_lost_during_checkpoint"')).toBe(0);
    expect(sample(before, prepares, 'operation="prepare",outcome="ok"')).toBe(0);
    await control(port, 'prepare', { checkpoint_id: 'c1', deadline_ts: deadline() });
    const victim = status.workers!.find((w) => w.index === 2)!;
    process.kill(victim.pid, 'SIGKILL');
    await until(() => !pidAlive(victim.pid));
    const after = await statusWhen(port, (s) => s.lost_workers === 1);
    expect(after).toMatchObject({ lost_during_checkpoint: [{ index: 2, pid: victim.pid }] });
    const text = await scrape(port);
    expect(sample(text, events, 'event="worker_lost"')).toBe(1);
    expect(sample(text, events, 'event="worker_lost_during_checkpoint"')).toBe(1);
    // The coordinator's plane ran the prepare (a worker runs none): counted once.
    expect(sample(text, prepares, 'operation="prepare",outcome="ok"')).toBe(1);
    child.kill('SIGTERM');
    await once(child, 'exit');
  }, 180_000);

  test('workers that lose their primary stop themselves with a non-zero exit', async () => {
    const { child, port, lines } = await start(2);
    const [, status] = await control(port, 'status');
    const pids = status.workers!.map((w) => w.pid);
    child.kill('SIGKILL');
    await until(() => pids.every((pid) => !pidAlive(pid)));
    await until(() => lines.filter((l) => l.event === 'worker_exit').length === 2);
    // Whichever comes first, the coordinator's socket closing or cluster's IPC channel, is a failure.
    const exits = lines.filter((l) => l.event === 'worker_exit').map((l) => l.code);
    expect([exits, exits.every((c) => c !== 0)]).toEqual([exits, true]);
    // The SIGKILLed primary could not remove its runtime directory (the next server start would).
    for (const name of runtimeDirsOf(child.pid!))
      rmSync(join('/tmp', name), { recursive: true, force: true });
  }, 180_000);
});
