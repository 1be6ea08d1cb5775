/** `serve` as the containers run it, and `up` in the foreground: the built bin, signals. */
import { spawn, spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { until } from '@ckpt-gym/testing';

import { attachStack, CLI_MAIN, ExitCode, RUN_FILE } from '../src/index.js';
import { ensureBuilt } from './support/build.js';
import { isAlive } from './support/cli.js';

let dir = '';

beforeAll(() => ensureBuilt(), 300_000);
beforeEach(() => {
  dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-serve-'));
  writeFileSync(
    join(dir, 'stack.yaml'),
    [
      'checkpoint: { enabled: true, control_auth_token: t }',
      'servers:',
      '  weather: { kind: resources, app: weather, port: 0 }',
      '  vllm: { kind: inference, app: vllm, port: 8000 }',
    ].join('\n'),
  );
});
afterEach(() => rmSync(dir, { recursive: true, force: true }));

test('serve prints one listening line, answers its health route, and exits 0 on SIGTERM', async () => {
  const child = spawn(
    process.execPath,
    [CLI_MAIN, 'serve', '--server', 'weather', '--config', 'stack.yaml'],
    {
      cwd: dir,
      stdio: ['ignore', 'pipe', 'pipe'],
    },
  );
  try {
    const line = await new Promise<string>((done, fail) => {
      let out = '';
      child.stdout.on('data', (chunk: Buffer) => {
        out += chunk.toString();
        const first = out.split('\n').find((l) => l.startsWith('{"event":"listening"'));
        if (first) done(first);
      });
      child.once('exit', (code) => fail(new Error(`serve exited ${code}: ${out}`)));
    });
    const listening = JSON.parse(line) as { server: string; kind: string; url: string };
    expect(listening).toMatchObject({ server: 'weather', kind: 'resources' });
    expect((await fetch(`${listening.url}/health`)).status).toBe(200);
    const exit = new Promise<number | null>((done) => child.once('exit', done));
    child.kill('SIGTERM');
    expect(await exit).toBe(0);
  } finally {
    if (child.exitCode === null) child.kill('SIGKILL');
  }
}, 60_000);

test('serve refuses an external inference backend (exit 1)', () => {
  const result = spawnSync(
    process.execPath,
    [CLI_MAIN, 'serve', '--server', 'vllm', '--config', 'stack.yaml'],
    {
      cwd: dir,
      encoding: 'utf8',
    },
  );
  expect(result.status).toBe(ExitCode.FAILURE);
  expect(result.stderr).toMatch(/external backend/);
});

test('up in the foreground starts every server and stops them all on SIGINT', async () => {
  writeFileSync(
    join(dir, 'stack.yaml'),
    [
      'servers:',
      '  inference: { kind: inference, app: fake, port: 0 }',
      '  weather: { kind: resources, app: weather, port: 0 }',
    ].join('\n'),
  );
  const child = spawn(
    process.execPath,
    [CLI_MAIN, 'up', '--config', 'stack.yaml', '--run-dir', 'run'],
    {
      cwd: dir,
      stdio: ['ignore', 'pipe', 'pipe'],
    },
  );
  let err = '';
  child.stderr.on('data', (chunk: Buffer) => (err += chunk.toString()));
  const exit = new Promise<number | null>((done) => child.once('exit', done));
  try {
    await until(() => err.includes('Ctrl-C stops the stack'), 'the stack to be up', 30_000);
    const run = JSON.parse(readFileSync(join(dir, 'run', RUN_FILE), 'utf8')) as {
      servers: { pid: number }[];
    };
    expect(run.servers.map((s) => isAlive(s.pid))).toEqual([true, true]);
    child.kill('SIGINT');
    expect(await exit).toBe(0);
    expect(run.servers.some((s) => isAlive(s.pid))).toBe(false);
    expect(existsSync(join(dir, 'run', RUN_FILE))).toBe(false);
  } finally {
    if (child.exitCode === null) child.kill('SIGKILL');
    if (existsSync(join(dir, 'run', RUN_FILE)))
      await attachStack(join(dir, 'run')).crash({ all: true });
  }
}, 60_000);
