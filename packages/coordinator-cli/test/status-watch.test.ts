/**
 * `status --watch` as a user runs it (the built bin, its stdout a pipe, so signals reach it)
 * against real gym servers: one line a refresh, the last checkpoint's stages showing up once a
 * checkpoint ran, and Ctrl-C (SIGINT) ending it with exit 0.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { until } from '@ckpt-gym/testing';

import { CLI_MAIN, runCli } from '../src/index.js';
import { ensureBuilt } from './support/build.js';
import { startStack, type TestStack, TOKEN, TOKEN_ENV } from './support/stack.js';

let dir = '';
let stack: TestStack | undefined;
const children: ChildProcess[] = [];

beforeAll(() => ensureBuilt(), 300_000);

beforeEach(() => {
  dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-watch-'));
});

afterEach(async () => {
  for (const child of children.splice(0)) if (child.exitCode === null) child.kill('SIGKILL');
  await stack?.close();
  stack = undefined;
  rmSync(dir, { recursive: true, force: true });
});

interface Watch {
  lines(): string[];
  stderr(): string;
  exit: Promise<number | null>;
  child: ChildProcess;
}

function watch(file: string, args: string[] = []): Watch {
  const child = spawn(
    process.execPath,
    [CLI_MAIN, 'status', '--watch', '--config', file, ...args],
    {
      cwd: dir,
      env: { ...process.env, [TOKEN_ENV]: TOKEN },
      stdio: ['ignore', 'pipe', 'pipe'],
    },
  );
  children.push(child);
  let stdout = '';
  let stderr = '';
  child.stdout?.on('data', (chunk: Buffer) => (stdout += chunk.toString()));
  child.stderr?.on('data', (chunk: Buffer) => (stderr += chunk.toString()));
  const exit = new Promise<number | null>((done) => child.once('exit', (code) => done(code)));
  return {
    // Complete lines only: the last one may still be arriving.
    lines: () => stdout.split('\n').slice(0, -1),
    stderr: () => stderr,
    exit,
    child,
  };
}

async function checkpoint(file: string, id: string): Promise<void> {
  const code = await runCli(['checkpoint', '--config', file, '--id', id, '--dir', join(dir, id)], {
    stdout: { write: () => true },
    stderr: { write: () => true },
    env: { [TOKEN_ENV]: TOKEN },
    cwd: dir,
  });
  expect(code).toBe(0);
}

interface WatchLine {
  at: string;
  servers: {
    server: string;
    phase: string;
    inflight: number | null;
    last_checkpoint: {
      checkpoint_id: string;
      operations: Record<string, { outcome: string }>;
    } | null;
  }[];
}

test('--json: one JSON object a refresh with every server, the last checkpoint once one ran; SIGINT exits 0', async () => {
  stack = await startStack(dir);
  stack.participant('env').start('r1');
  const running = watch(stack.file, ['--json']);
  await until(() => running.lines().length >= 2, 'two refreshes', 30_000);
  const first = JSON.parse(running.lines()[0]!) as WatchLine;
  expect(first.servers.map((s) => [s.server, s.phase])).toEqual([
    ['env', 'idle'],
    ['policy', 'idle'],
    ['tools', 'idle'],
  ]);
  expect(first.servers[0]).toMatchObject({ inflight: 1, last_checkpoint: null });

  stack.participant('env').start('r1', 'parked');
  await checkpoint(stack.file, 'watched-1');
  const parsed = () => running.lines().map((line) => JSON.parse(line) as WatchLine);
  await until(
    () =>
      parsed().some((l) =>
        l.servers.every((s) => s.last_checkpoint?.checkpoint_id === 'watched-1'),
      ),
    'a refresh after the checkpoint',
    30_000,
  );
  const after = parsed().find((l) => l.servers[0]?.last_checkpoint !== null)!;
  expect(Object.entries(after.servers[0]!.last_checkpoint!.operations)).toEqual([
    ['prepare', expect.objectContaining({ outcome: 'ok' })],
    ['commit', expect.objectContaining({ outcome: 'ok' })],
  ]);

  running.child.kill('SIGINT');
  expect(await running.exit).toBe(0);
  expect(running.stderr()).toBe('');
  for (const line of running.lines())
    expect(Object.keys(JSON.parse(line) as object)).toEqual(['at', 'servers']);
}, 90_000);

test('plain text: one line a refresh while stdout is not a terminal, a server going down shown as failing', async () => {
  stack = await startStack(dir);
  const running = watch(stack.file);
  await until(() => running.lines().length >= 1, 'a refresh', 30_000);
  expect(running.lines()[0]).toMatch(
    /^\d{4}-\d\d-\d\dT[\d:.]+Z env phase=idle inflight=0 held=- waiting=- \| policy phase=idle .* \| tools phase=idle /,
  );
  await stack.close();
  stack = undefined;
  const seen = running.lines().length;
  await until(
    () =>
      running
        .lines()
        .slice(seen)
        .some((line) => line.includes('env phase=error')),
    'a refresh naming the servers down',
    30_000,
  );
  running.child.kill('SIGINT');
  expect(await running.exit).toBe(0);
  expect(running.lines().every((line) => !line.includes('\x1b'))).toBe(true);
}, 90_000);

test('a reader that goes away (| head -n 1) ends the watch quietly with exit 0', async () => {
  stack = await startStack(dir);
  const running = watch(stack.file, ['--json']);
  await until(() => running.lines().length >= 1, 'one refresh', 30_000);
  // What `head` does once it has its line: close its end of the pipe.
  running.child.stdout?.destroy();
  expect(await running.exit).toBe(0);
  expect(running.stderr()).toBe('');
});
