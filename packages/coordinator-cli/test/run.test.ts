/**
 * `run` as a user runs it (the built bin, so signals can reach it) against a real local stack:
 * SIGTERM checkpoints with stop and exits 75; after a crash, `--resume` restores the checkpoint,
 * continues the rollouts in flight as their next attempt and writes each result exactly once.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { until } from '@ckpt-gym/testing';

import {
  CLI_MAIN,
  demoStackText,
  ExitCode,
  freePort,
  launchStack,
  type StackHandle,
  weatherTask,
} from '../src/index.js';
import { CollectionDir } from '../src/collection/files.js';
import { ensureBuilt } from './support/build.js';
let dir = '';
let stack: StackHandle | undefined;
const children: ChildProcess[] = [];

beforeAll(() => ensureBuilt(), 300_000);

beforeEach(() => {
  dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-run-'));
});

afterEach(async () => {
  for (const child of children.splice(0)) if (child.exitCode === null) child.kill('SIGKILL');
  await stack?.crash({ all: true });
  stack = undefined;
  rmSync(dir, { recursive: true, force: true });
});

function runCli(args: string[]): { child: ChildProcess; exit: Promise<number | null> } {
  const child = spawn(
    process.execPath,
    [CLI_MAIN, 'run', '--input', 'tasks.jsonl', '--output', 'results.jsonl', ...args],
    { cwd: dir, stdio: ['ignore', 'pipe', 'pipe'] },
  );
  children.push(child);
  let output = '';
  child.stdout?.on('data', (chunk: Buffer) => (output += chunk.toString()));
  child.stderr?.on('data', (chunk: Buffer) => (output += chunk.toString()));
  const exit = new Promise<number | null>((done) =>
    child.once('exit', (code) => {
      if (code !== 0 && code !== ExitCode.COLLECTION_STOPPED) process.stderr.write(output);
      done(code);
    }),
  );
  return { child, exit };
}

/** A rollout id without its run's prefix: the task key (`r<line>`). */
const taskKey = (rolloutId: string) => rolloutId.slice(rolloutId.indexOf('.') + 1);

function results(): {
  run_id: string;
  rollout_id: string;
  attempt: number;
  result: { reward: number };
}[] {
  const path = join(dir, 'results.jsonl');
  if (!existsSync(path)) return [];
  return readFileSync(path, 'utf8')
    .split('\n')
    .filter((line) => line !== '')
    .map((line) => JSON.parse(line) as ReturnType<typeof results>[number]);
}

async function backend(path: string, body?: unknown): Promise<unknown> {
  const url = stack!.servers.get('inference')!.url;
  const reply = await fetch(`${url}${path}`, {
    method: body === undefined ? 'GET' : 'POST',
    headers: { 'content-type': 'application/json' },
    ...(body === undefined ? {} : { body: JSON.stringify(body) }),
  });
  return reply.json();
}

/** How many model calls the fake backend holds and has not answered. */
async function heldCalls(): Promise<number> {
  const { calls } = (await backend('/_ctl/calls')) as {
    calls: { held: boolean; returned: boolean; dropped: boolean }[];
  };
  return calls.filter((c) => c.held && !c.returned && !c.dropped).length;
}

test('SIGTERM checkpoints with stop and exits 75; --resume after a crash writes every result exactly once', async () => {
  writeFileSync(join(dir, 'stack.yaml'), demoStackText(await freePort('127.0.0.1'), 'run-token'));
  stack = await launchStack({ configPath: join(dir, 'stack.yaml'), runDir: join(dir, 'run') });
  writeFileSync(
    join(dir, 'tasks.jsonl'),
    [1, 2, 3, 4].map((i) => JSON.stringify(weatherTask(i))).join('\n') + '\n',
  );
  const config = ['--config', join(dir, 'run', 'stack.yaml'), '--concurrency', '4'];

  await backend('/_ctl/hold', { after_calls_per_rollout: 1 });
  const first = runCli(config);
  await until(
    async () => (await heldCalls()) === 4,
    'four rollouts at their second model call',
    30_000,
  );
  await backend('/_ctl/step', { calls: 1 });
  await until(() => results().length === 1, 'one result', 30_000);
  first.child.kill('SIGTERM');
  expect(await first.exit).toBe(ExitCode.COLLECTION_STOPPED);
  expect(results()).toHaveLength(1);

  await stack.crash();
  await stack.restart();
  await backend('/_ctl/release', {});
  const second = runCli([...config, '--resume']);
  expect(await second.exit).toBe(ExitCode.OK);

  const rows = results();
  expect(rows.map((r) => taskKey(r.rollout_id)).sort()).toEqual(['r1', 'r2', 'r3', 'r4']);
  expect(new Set(rows.map((r) => r.run_id)).size).toBe(1);
  expect(rows.every((r) => r.result.reward === 1)).toBe(true);
  // The one finished before the checkpoint ran once; the others continued as attempt 1.
  expect(rows.map((r) => r.attempt).sort()).toEqual([0, 1, 1, 1]);
}, 180_000);

test('SIGUSR1 takes a checkpoint and the collection goes on', async () => {
  writeFileSync(join(dir, 'stack.yaml'), demoStackText(await freePort('127.0.0.1'), 'run-token'));
  stack = await launchStack({ configPath: join(dir, 'stack.yaml'), runDir: join(dir, 'run') });
  writeFileSync(
    join(dir, 'tasks.jsonl'),
    [1, 2].map((i) => JSON.stringify(weatherTask(i))).join('\n') + '\n',
  );
  await backend('/_ctl/hold', { after_calls_per_rollout: 1 });
  const collection = runCli(['--config', join(dir, 'run', 'stack.yaml')]);
  await until(
    async () => (await heldCalls()) === 2,
    'two rollouts at their second model call',
    30_000,
  );
  collection.child.kill('SIGUSR1');
  const checkpoints = new CollectionDir(join(dir, 'results.jsonl.checkpoints'));
  await until(() => checkpoints.latest() !== undefined, 'a published checkpoint', 30_000);
  const continued = checkpoints.latest()!.manifest.continued;
  expect(continued.map((e) => [taskKey(e.rollout_id), e.attempt])).toEqual([
    ['r1', 0],
    ['r2', 0],
  ]);
  await backend('/_ctl/release', {});
  expect(await collection.exit).toBe(ExitCode.OK);
  expect(results().map((r) => [taskKey(r.rollout_id), r.attempt, r.result.reward])).toEqual(
    expect.arrayContaining([
      ['r1', 0, 1],
      ['r2', 0, 1],
    ]),
  );
  expect(results()).toHaveLength(2);
}, 180_000);

test('--resume without a checkpoint retires each rollout at its journaled attempt and starts it over', async () => {
  writeFileSync(join(dir, 'stack.yaml'), demoStackText(await freePort('127.0.0.1'), 'run-token'));
  stack = await launchStack({ configPath: join(dir, 'stack.yaml'), runDir: join(dir, 'run') });
  writeFileSync(
    join(dir, 'tasks.jsonl'),
    [1, 2].map((i) => JSON.stringify(weatherTask(i))).join('\n') + '\n',
  );
  const config = ['--config', join(dir, 'run', 'stack.yaml')];
  await backend('/_ctl/hold', { after_calls_per_rollout: 1 });
  const first = runCli(config);
  await until(
    async () => (await heldCalls()) === 2,
    'two rollouts at their second model call',
    30_000,
  );
  // The controller dies too: no checkpoint, only the attempt journal.
  first.child.kill('SIGKILL');
  await first.exit;
  await stack.crash();
  await stack.restart();
  await backend('/_ctl/release', {});

  const second = runCli([...config, '--resume']);
  expect(await second.exit).toBe(ExitCode.OK);
  expect(results().map((r) => [taskKey(r.rollout_id), r.attempt, r.result.reward])).toEqual(
    expect.arrayContaining([
      ['r1', 1, 1],
      ['r2', 1, 1],
    ]),
  );
  expect(results()).toHaveLength(2);
}, 180_000);

test('LATEST naming a checkpoint without a readable collection.json is refused, naming the file', () => {
  const root = mkdtempSync(join(tmpdir(), 'ckpt-gym-latest-'));
  try {
    const collection = new CollectionDir(root);
    expect(collection.latest()).toBeUndefined();
    writeFileSync(join(root, 'LATEST'), 'ckpt-1\n');
    const path = join(root, 'ckpt-1', 'collection.json');
    expect(() => collection.latest()).toThrow(`LATEST names ckpt-1, which has no ${path}`);
    mkdirSync(join(root, 'ckpt-1'));
    writeFileSync(path, '{"checkpoint_id": "ckpt-1",');
    expect(() => collection.latest()).toThrow(`${path} is not a collection manifest`);
    const manifest = { checkpoint_id: 'ckpt-1', run_id: 'run-a', leg: 0, created_at: 1 };
    writeFileSync(path, JSON.stringify({ ...manifest, continued: [], restarted: [] }));
    expect(collection.latest()?.manifest.run_id).toBe('run-a');
  } finally {
    rmSync(root, { recursive: true, force: true });
  }
});
