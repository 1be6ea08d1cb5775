/**
 * Two policy model servers as two processes (the package's bin over the compiled `dist/`), sharing one capture
 * directory and one fake backend. The package and its workspace dependencies are built first.
 */
import { deadline, episodes, until } from '@ckpt-gym/testing';
import { type ChildProcess, execFileSync, spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { readdir, readFile, writeFile } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { createInterface } from 'node:readline';

import { afterEach, beforeAll, describe, expect, it, jest } from '@jest/globals';

import {
  chat,
  cleanup,
  control,
  fakeCalls,
  fakeCtl,
  type Harness,
  startFake,
  tempDir,
  TOKEN,
} from './support.js';

jest.setTimeout(120_000);

const repo = resolve(import.meta.dirname, '../../..');
const main = join(repo, 'packages/policy-model-server/bin/ckpt-gym-policy-model.js');

beforeAll(() => {
  const build = (pkg: string) =>
    execFileSync(
      process.execPath,
      [join(repo, 'node_modules/typescript/bin/tsc'), '-p', `packages/${pkg}/tsconfig.build.json`],
      {
        cwd: repo,
        stdio: 'inherit',
      },
    );
  for (const dep of ['core', 'fake-inference']) {
    if (
      !existsSync(join(repo, `packages/${dep}/dist/${dep === 'core' ? 'api/server' : 'index'}.js`))
    )
      build(dep);
  }
  // Always: this package's dist must be the sources under test.
  build('policy-model-server');
});

const children: ChildProcess[] = [];
afterEach(async () => {
  for (const child of children.splice(0)) {
    if (child.exitCode === null) {
      const exited = new Promise((done) => child.once('exit', done));
      child.kill('SIGTERM');
      await exited;
    }
  }
  await cleanup();
});

async function stackFile(backend: string, captureDir: string): Promise<string> {
  const dir = await tempDir();
  const file = join(dir, 'stack.yaml');
  const server = (name: string) =>
    `  ${name}: { kind: model, app: policy, port: 0, backend_url: ${JSON.stringify(backend)}, checkpoint_policy: true }`;
  await writeFile(
    file,
    [
      `checkpoint: { enabled: true, control_auth_token: ${TOKEN} }`,
      `token_capture: { enabled: true, dir: ${JSON.stringify(captureDir)} }`,
      'servers:',
      server('policy_a'),
      server('policy_b'),
    ].join('\n'),
  );
  return file;
}

/** Spawns one server process and resolves with its URL from the listening line. */
async function spawnServer(config: string, name: string): Promise<Pick<Harness, 'url'>> {
  const child = spawn(process.execPath, [main, '--config', config, '--server', name], {
    stdio: ['ignore', 'pipe', 'inherit'],
    env: { ...process.env, CKPT_GYM_LOG_LEVEL: 'error' },
  });
  children.push(child);
  const lines = createInterface({ input: child.stdout! });
  for await (const line of lines) {
    const event = JSON.parse(line) as { event?: string; url?: string; server?: string };
    if (event.event === 'listening') {
      expect(event.server).toBe(name);
      return { url: event.url! };
    }
  }
  throw new Error(`${name} exited before listening`);
}

async function prepare(url: string, id: string) {
  const reply = await control(url, 'prepare', { checkpoint_id: id, deadline_ts: deadline() });
  expect(reply.body).toMatchObject({ phase: 'prepared' });
}

async function commit(url: string, id: string, dir: string, scope: string[]) {
  const reply = await control(url, 'commit', {
    checkpoint_id: id,
    deadline_ts: deadline(),
    checkpoint_dir: dir,
    episode_ids: episodes(...scope),
  });
  expect(reply.status).toBe(200);
  return reply.body as Record<string, unknown>;
}

const resume = (url: string, id: string) =>
  control(url, 'resume', { checkpoint_id: id, deadline_ts: deadline() });

async function exportedRows(dir: string, server: string): Promise<unknown[]> {
  const participantDir = join(dir, 'gym', 'model', server);
  const file = (await readdir(participantDir)).find((f) => f.startsWith('records'))!;
  const text = await readFile(join(participantDir, file), 'utf8');
  return text
    .split('\n')
    .filter(Boolean)
    .flatMap((line) => (JSON.parse(line) as { rows: unknown[] }).rows);
}

async function ledgerRows(captureDir: string, key: string): Promise<unknown[]> {
  const path = join(captureDir, `${key}.lineage.jsonl`);
  if (!existsSync(path)) return [];
  return (await readFile(path, 'utf8')).split('\n').filter(Boolean);
}

describe('two policy servers (two processes) sharing one capture directory', () => {
  it('one holding a completed response: neither snapshot, nor the restored ledger, holds its row', async () => {
    const fake = await startFake();
    const captureDir = await tempDir();
    const config = await stackFile(`${fake.url}/v1`, captureDir);
    const [a, b] = await Promise.all([
      spawnServer(config, 'policy_a'),
      spawnServer(config, 'policy_b'),
    ]);

    expect((await chat(a.url, 'r')).status).toBe(200);
    await fakeCtl(fake, 'hold', { after_calls: 1 });
    const held = chat(b.url, 'r');
    await until(async () => (await fakeCalls(fake)).length === 2, 'the second call');
    await prepare(a.url, 'c1');
    await prepare(b.url, 'c1');
    await fakeCtl(fake, 'release');
    await until(async () => (await fakeCalls(fake))[1]?.returned === true, 'the backend to answer');

    const dir = await tempDir();
    await commit(a.url, 'c1', dir, ['r']);
    await commit(b.url, 'c1', dir, ['r']);
    expect(await exportedRows(dir, 'policy_a')).toHaveLength(1);
    expect(await exportedRows(dir, 'policy_b')).toHaveLength(1);
    await resume(a.url, 'c1');
    await resume(b.url, 'c1');
    expect((await held).status).toBe(200);
    expect(await ledgerRows(captureDir, 'r')).toHaveLength(2);

    // Restore into two fresh processes.
    for (const child of children.splice(0)) {
      const exited = new Promise((done) => child.once('exit', done));
      child.kill('SIGTERM');
      await exited;
    }
    const [c, d] = await Promise.all([
      spawnServer(config, 'policy_a'),
      spawnServer(config, 'policy_b'),
    ]);
    for (const server of [c, d]) {
      const restored = await control(server.url, 'restore', {
        checkpoint_id: 'c2',
        deadline_ts: deadline(),
        checkpoint_dir: dir,
        episode_ids: episodes('r'),
      });
      expect(restored.body).toMatchObject({ phase: 'restored', restored: ['r-a1'] });
    }
    expect(await ledgerRows(captureDir, 'r-a1')).toHaveLength(1);
  });

  it('a restored attempt started on one server keeps its ledger when a commit on the other leaves it out of scope', async () => {
    const fake = await startFake();
    const captureDir = await tempDir();
    const config = await stackFile(`${fake.url}/v1`, captureDir);
    const dir = await tempDir();
    {
      const [a, b] = await Promise.all([
        spawnServer(config, 'policy_a'),
        spawnServer(config, 'policy_b'),
      ]);
      await chat(a.url, 'r');
      await chat(a.url, 's');
      for (const server of [a, b]) await prepare(server.url, 'c1');
      for (const server of [a, b]) await commit(server.url, 'c1', dir, ['r', 's']);
      for (const child of children.splice(0)) {
        const exited = new Promise((done) => child.once('exit', done));
        child.kill('SIGTERM');
        await exited;
      }
    }
    const [c, d] = await Promise.all([
      spawnServer(config, 'policy_a'),
      spawnServer(config, 'policy_b'),
    ]);
    for (const server of [c, d]) {
      await control(server.url, 'restore', {
        checkpoint_id: 'c2',
        deadline_ts: deadline(),
        checkpoint_dir: dir,
        episode_ids: episodes('r', 's'),
      });
      await resume(server.url, 'c2');
    }
    expect((await chat(c.url, 'r-a1')).status).toBe(200);
    // d never saw r-a1 start; its commit no longer names r-a1 or s-a1.
    await prepare(d.url, 'c3');
    await commit(d.url, 'c3', await tempDir(), []);
    expect(await ledgerRows(captureDir, 'r-a1')).toHaveLength(2);
    expect(await ledgerRows(captureDir, 's-a1')).toEqual([]);
    expect(existsSync(join(captureDir, 's-a1.lineage.retired'))).toBe(false);
    expect(existsSync(join(captureDir, 's-a1.lineage.started'))).toBe(false);
  });
});

describe('the CLI', () => {
  it('a model server outside the checkpoint gate that an agent with token capture names is refused at startup', async () => {
    const dir = await tempDir();
    const config = join(dir, 'stack.yaml');
    await writeFile(
      config,
      [
        `checkpoint: { enabled: true, control_auth_token: ${TOKEN} }`,
        `token_capture: { enabled: true, dir: ${JSON.stringify(join(dir, 'capture'))} }`,
        'servers:',
        '  judge: { kind: model, app: policy, port: 0, backend_url: "http://127.0.0.1:1/v1" }',
        '  simple_agent: { kind: agent, app: simple, port: 0, model_server: judge }',
      ].join('\n'),
    );
    const child = spawn(process.execPath, [main, '--config', config, '--server', 'judge'], {
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let stderr = '';
    child.stderr!.on('data', (chunk: Buffer) => (stderr += chunk.toString()));
    const code = await new Promise((done) => child.once('exit', done));
    expect(code).toBe(2);
    expect(stderr).toContain('simple_agent');
    expect(stderr).toContain('judge');
    expect(stderr).toContain('checkpoint_policy');
  });

  it('prints a listening line and exits 0 on SIGTERM', async () => {
    const fake = await startFake();
    const config = await stackFile(`${fake.url}/v1`, await tempDir());
    const server = await spawnServer(config, 'policy_a');
    expect((await chat(server.url, 'r')).status).toBe(200);
    const child = children.pop()!;
    const exited = new Promise((done) => child.once('exit', done));
    child.kill('SIGTERM');
    expect(await exited).toBe(0);
  });
});
