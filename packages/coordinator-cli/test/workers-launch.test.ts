/**
 * A policy model with `num_workers: 2` as `up`, `status`, `crash` and `down` run it: real `serve`
 * processes (a primary and the two workers it forks, all in its process group), through runCli.
 */
import { spawn } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { until } from '@ckpt-gym/testing';

import { CLI_MAIN, ExitCode, freePort, parentPid } from '../src/index.js';
import { hasListeningLine } from '../src/launcher.js';
import { ensureBuilt } from './support/build.js';
import { cli, isAlive, removeTestDir } from './support/cli.js';

let dir = '';

beforeAll(() => ensureBuilt(), 300_000);

beforeEach(async () => {
  dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-workers-'));
  const backend = await freePort('127.0.0.1');
  writeFileSync(
    join(dir, 'stack.yaml'),
    [
      'checkpoint: { enabled: true, control_auth_token: workers-token }',
      'servers:',
      `  inference: { kind: inference, app: fake, port: ${backend} }`,
      '  policy: { kind: model, app: policy, port: 0, num_workers: 2, checkpoint_policy: true,',
      `            backend_url: "http://127.0.0.1:${backend}/v1" }`,
      '',
    ].join('\n'),
  );
});

afterEach(() => removeTestDir(dir));

interface WorkerEntry {
  index: number;
  pid: number;
  ready: boolean;
}

/** `up --detach`: the policy primary's pid. */
async function up(): Promise<number> {
  const started = await cli(
    ['up', '--detach', '--config', 'stack.yaml', '--run-dir', 'run', '--json'],
    dir,
  );
  expect([started.code, started.stderr]).toEqual([ExitCode.OK, expect.any(String)]);
  const servers = started.json().servers as { name: string; pid: number }[];
  return servers.find((s) => s.name === 'policy')?.pid ?? 0;
}

/** The policy's workers, as `status --json` reports them once both joined its coordinator. */
async function joinedWorkers(): Promise<WorkerEntry[]> {
  let workers: WorkerEntry[] = [];
  await until(
    async () => {
      const status = await cli(['status', '--config', 'run/stack.yaml', '--json'], dir);
      const rows = status.json().servers as { server: string; status?: { workers?: unknown } }[];
      workers = (rows.find((r) => r.server === 'policy')?.status?.workers ?? []) as WorkerEntry[];
      return workers.length === 2;
    },
    'both policy workers joined',
    60_000,
  );
  return workers;
}

/** The first line of `status --watch --json` (a real process, its stdout a pipe), then Ctrl-C. */
async function oneWatchLine(): Promise<{ servers: { server: string; workers: unknown }[] }> {
  const child = spawn(
    process.execPath,
    [CLI_MAIN, 'status', '--watch', '--json', '--config', 'run/stack.yaml'],
    { cwd: dir, stdio: ['ignore', 'pipe', 'inherit'] },
  );
  let output = '';
  child.stdout.on('data', (chunk: Buffer) => (output += chunk.toString()));
  const exit = new Promise<number | null>((done) => child.once('exit', (code) => done(code)));
  await until(() => output.includes('\n'), 'a refresh', 30_000);
  child.kill('SIGINT');
  expect(await exit).toBe(0);
  return JSON.parse(output.split('\n')[0]!) as { servers: { server: string; workers: unknown }[] };
}

/** Whether process group `pgid` still has a process. */
function groupAlive(pgid: number): boolean {
  try {
    process.kill(-pgid, 0);
    return true;
  } catch {
    return false;
  }
}

/** The runtime directories under /tmp of the process `pid` (`cg-<pid>-…`). */
function runtimeDirsOf(pid: number): string[] {
  return readdirSync('/tmp').filter((name) => name.startsWith(`cg-${pid}-`));
}

test('up runs the workers in the primary’s group; status lists them; crash kills them all and a fresh up finds no stale state', async () => {
  const primary = await up();
  const workers = await joinedWorkers();
  for (const worker of workers) expect(parentPid(worker.pid)).toBe(primary);
  expect(runtimeDirsOf(primary)).toHaveLength(1);

  const text = await cli(['status', '--config', 'run/stack.yaml'], dir);
  expect(text.code).toBe(ExitCode.OK);
  expect(text.stdout).toMatch(/^workers:\nSERVER +WORKER +PID +READY$/m);
  for (const worker of workers) {
    expect(text.stdout).toMatch(new RegExp(`^policy +${worker.index} +${worker.pid} +-$`, 'm'));
  }

  const watched = await oneWatchLine();
  expect(watched.servers.find((s) => s.server === 'policy')?.workers).toEqual({
    workers: workers.map((w) => ({ ...w, ready: false })),
    expected: 2,
    lost: 0,
  });

  expect((await cli(['crash', '--run-dir', 'run'], dir)).code).toBe(ExitCode.OK);
  for (const pid of [primary, ...workers.map((w) => w.pid)]) expect(isAlive(pid)).toBe(false);

  const next = await up();
  expect(next).not.toBe(primary);
  const fresh = await joinedWorkers();
  for (const worker of fresh) expect(parentPid(worker.pid)).toBe(next);
  // The killed primary's runtime directory was cleaned when the new one started.
  expect(runtimeDirsOf(primary)).toEqual([]);
}, 180_000);

test('down stops the primary and its workers cleanly: no worker reported lost, its runtime directory removed', async () => {
  const primary = await up();
  const workers = await joinedWorkers();
  const down = await cli(['down', '--run-dir', 'run'], dir);
  expect(down.code).toBe(ExitCode.OK);
  for (const pid of [primary, ...workers.map((w) => w.pid)]) expect(isAlive(pid)).toBe(false);
  expect(runtimeDirsOf(primary)).toEqual([]);
  const log = readFileSync(join(dir, 'run', 'logs', 'policy.log'), 'utf8');
  expect(log).not.toMatch(/"level":"(warn|error)"/);
}, 180_000);

test('serve through the bin as the image runs it: its workers re-run it; Ctrl-C (SIGINT to the group) stops them all cleanly', async () => {
  // The image's entry point: /usr/local/bin/ckpt-gym, a symlink to the bin, which its shebang
  // runs as `node /usr/local/bin/ckpt-gym …`.
  const bin = join(dir, 'ckpt-gym');
  symlinkSync(CLI_MAIN, bin);
  const child = spawn(
    process.execPath,
    [bin, 'serve', '--config', 'stack.yaml', '--server', 'policy'],
    {
      cwd: dir,
      detached: true,
      stdio: ['ignore', 'pipe', 'pipe'],
      env: { ...process.env, NODE_OPTIONS: '--max-semi-space-size=64' },
    },
  );
  let output = '';
  child.stdout.on('data', (chunk: Buffer) => (output += chunk.toString()));
  child.stderr.on('data', (chunk: Buffer) => (output += chunk.toString()));
  const exit = new Promise<number | null>((done) => child.once('exit', (code) => done(code)));
  try {
    await until(() => hasListeningLine(output), 'the listening line', 60_000);
    const workers = readdirSync('/proc').filter(
      (name) => /^\d+$/.test(name) && parentPid(Number(name)) === child.pid,
    );
    expect(workers).toHaveLength(2);
    for (const pid of workers) {
      const argv = readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0');
      expect(argv.slice(1, 3)).toEqual([bin, 'serve']);
    }
    // A terminal's Ctrl-C: the signal reaches every process of the foreground group at once.
    process.kill(-child.pid!, 'SIGINT');
    expect(await exit).toBe(0);
    await until(() => !groupAlive(child.pid!), 'every worker gone', 30_000);
    expect(output).not.toMatch(/"level":"(warn|error)"/);
  } finally {
    if (groupAlive(child.pid!)) process.kill(-child.pid!, 'SIGKILL');
  }
}, 120_000);
