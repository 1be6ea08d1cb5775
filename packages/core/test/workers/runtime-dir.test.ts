import { type ChildProcess, spawn } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { once } from 'node:events';

import { cleanStaleRuntimeDirs } from '../../src/workers/runtime-dir.js';
import { removeTranspiled, transpileCore } from '../support/transpile.js';

const FIXTURE = join(import.meta.dirname, '..', 'fixtures', 'runtime-dir-process.mjs');
let core = '';
let root = '';

beforeAll(async () => {
  core = await transpileCore();
}, 120_000);
afterAll(async () => {
  await removeTranspiled(core);
});
beforeEach(() => {
  root = mkdtempSync('/tmp/cgt-');
});
afterEach(() => {
  rmSync(root, { recursive: true, force: true });
});

/** Starts the fixture; resolves with the child and the runtime dir it printed. */
async function start(mode: string): Promise<{ child: ChildProcess; path: string }> {
  const child = spawn(process.execPath, [FIXTURE, core, root, mode], {
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  const [chunk] = (await once(child.stdout!, 'data')) as [Buffer];
  return { child, path: (JSON.parse(chunk.toString('utf8')) as { path: string }).path };
}

async function exitOf(child: ChildProcess): Promise<[number | null, string | null]> {
  if (child.exitCode !== null || child.signalCode !== null)
    return [child.exitCode, child.signalCode];
  const [code, signal] = (await once(child, 'exit')) as [number | null, string | null];
  return [code, signal];
}

/** A pid no process has now: a child that already exited. */
async function deadPid(): Promise<number> {
  const child = spawn(process.execPath, ['-e', '0']);
  await once(child, 'exit');
  return child.pid!;
}

describe('the runtime directory of a server process', () => {
  test('a short path under the root, named by pid, removed at a normal exit', async () => {
    const { child, path } = await start('exit');
    expect(path).toMatch(new RegExp(`^${root}/cg-${child.pid}-[0-9a-f]{8}$`));
    expect(path.length).toBeLessThan(60);
    expect(await exitOf(child)).toEqual([0, null]);
    expect(existsSync(path)).toBe(false);
  });

  test('removed on SIGTERM and on SIGINT, and the process exits 0', async () => {
    for (const signal of ['SIGTERM', 'SIGINT'] as const) {
      const { child, path } = await start('wait');
      expect(existsSync(path)).toBe(true);
      child.kill(signal);
      expect(await exitOf(child)).toEqual([0, null]);
      expect(existsSync(path)).toBe(false);
    }
  });

  test('a process with its own SIGTERM listener keeps its exit, and the directory still goes', async () => {
    const { child, path } = await start('own-sigterm');
    child.kill('SIGTERM');
    expect(await exitOf(child)).toEqual([3, null]);
    expect(existsSync(path)).toBe(false);
  });

  test('a stale directory whose pid is dead is cleaned at start; a live one is kept', async () => {
    const stale = join(root, `cg-${await deadPid()}-0badc0de`);
    const live = join(root, `cg-${process.pid}-0000abcd`);
    const other = join(root, 'cg-not-a-runtime-dir');
    for (const dir of [stale, live, other]) mkdirSync(dir);
    const { child, path } = await start('exit');
    await exitOf(child);
    expect([existsSync(stale), existsSync(live), existsSync(other), existsSync(path)]).toEqual([
      false,
      true,
      true,
      false,
    ]);
  });

  test('cleanStaleRuntimeDirs names what it removed', async () => {
    const stale = join(root, `cg-${await deadPid()}-12345678`);
    mkdirSync(stale);
    expect(cleanStaleRuntimeDirs(root)).toEqual([stale]);
    expect(cleanStaleRuntimeDirs(root)).toEqual([]);
  });
});
