/**
 * #3893 with real processes: timer checkpoints keep the newest two with LATEST on the newest; a
 * restore a server refuses falls back to restarting those rows; a second crash after a resume
 * never reuses an attempt number; `checkpoint-now` and SIGTERM reach a collector run under npx.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { existsSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';

import { DISPATCH_LOG, processAlive } from '@ckpt-gym/coordinator-cli';

import { Collection, taskKey, weatherTasks } from './collect-kit.js';
import { until } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';

afterEach(closeAll);

const REPO = resolve(import.meta.dirname, '../..');
const KEYS = ['c1', 'c2', 'c3', 'c4'];

/** Starts the collection with every rollout held at its second model call. */
async function heldCollection(dep: Deployment, name: string, extra: string[] = []) {
  const col = new Collection(dep, name, weatherTasks(KEYS));
  await dep.backend('/_ctl/hold', { after_calls_per_rollout: 1 });
  const run = dep.cli(col.args(extra));
  await dep.waitForCalls(2 * KEYS.length);
  return { col, run };
}

/** Stops a held collection with SIGTERM (exit 75), crashes the gym, starts it again. */
async function stopAndCrash(dep: Deployment, run: ReturnType<Deployment['cli']>, release = true) {
  run.child.kill('SIGTERM');
  expect(await run.exited).toBe(75);
  await dep.crash();
  if (release) await dep.backend('/_ctl/release', {});
  await dep.restart();
}

scenario('timer checkpoints: LATEST names the newest, the two newest are kept', async () => {
  const dep = await Deployment.start('native');
  const { col, run } = await heldCollection(dep, 'timer', ['--checkpoint-every', '0.3']);
  await until(
    () => (run.output().match(/published \(LATEST\)/g) ?? []).length >= 3,
    '3 checkpoints',
    30_000,
  );
  await dep.backend('/_ctl/release', {});
  expect(await run.exited).toBe(0);

  const kept = col.published();
  expect(kept).toHaveLength(2);
  const latest = col.dir().latest()!;
  const created = kept.map(
    (name) =>
      (
        JSON.parse(readFileSync(join(col.checkpointDir, name, 'collection.json'), 'utf8')) as {
          created_at: number;
        }
      ).created_at,
  );
  expect(latest.manifest.created_at).toBe(Math.max(...created));
  expect(kept).toContain(latest.manifest.checkpoint_id);
  // Nothing else is left behind: no partial checkpoint, no temporary file.
  expect(readdirSync(col.checkpointDir).sort()).toEqual([DISPATCH_LOG, 'LATEST', ...kept].sort());
  expect(col.rows().every((r) => r.result?.reward === 1 && r.attempt === 0)).toBe(true);
});

scenario(
  'a restore a server refuses falls back to restarting those rows; the run finishes',
  async () => {
    const dep = await Deployment.start('native');
    const { col, run } = await heldCollection(dep, 'refused');
    run.child.kill('SIGTERM');
    expect(await run.exited).toBe(75);
    await dep.crash();
    // The agent's records no longer match their digest: the agent refuses the restore.
    const latest = col.dir().latest()!;
    const agentDir = join(latest.dir, 'gym', 'agent', 'simple_agent');
    const records = readdirSync(agentDir).find((name) => name.startsWith('records'))!;
    const text = readFileSync(join(agentDir, records), 'utf8');
    writeFileSync(join(agentDir, records), text.replace(/"/, "'"));
    await dep.backend('/_ctl/release', {});
    await dep.restart();

    const resumed = dep.cli([...col.args(), '--resume']);
    expect(await resumed.exited).toBe(0);
    expect(resumed.output()).toMatch(/warning: restoring .* failed .*start over from their input/);
    const rows = col.rows();
    expect(rows.map((r) => taskKey(r.rollout_id)).sort()).toEqual(KEYS);
    // Committed at attempt 0, the failed restore's attempt 1 retired: each row starts over as 2.
    expect(rows.map((r) => [r.attempt, r.result?.reward])).toEqual(KEYS.map(() => [2, 1]));
  },
);

scenario('a second crash after a resume never reuses an attempt number', async () => {
  const dep = await Deployment.start('native');
  const { col, run } = await heldCollection(dep, 'twice');
  await stopAndCrash(dep, run, false);

  // Leg 1 restores and sends attempt 1 (held again), then it and the gym die before a checkpoint.
  const before = await dep.callCount();
  const leg1 = dep.cli([...col.args(), '--resume']);
  await dep.waitForCalls(before + KEYS.length);
  leg1.child.kill('SIGKILL');
  await leg1.exited;
  await dep.crash();
  await dep.backend('/_ctl/release', {});
  await dep.restart();
  const seen = await dep.callCount();

  const leg2 = dep.cli([...col.args(), '--resume']);
  expect(await leg2.exited).toBe(0);
  expect(leg2.output()).toMatch(
    /its checkpoint is not restored: leg 0 published it and leg 1 ran after it/,
  );
  const rows = col.rows();
  expect(rows.map((r) => [taskKey(r.rollout_id), r.attempt, r.result?.reward]).sort()).toEqual(
    KEYS.map((key) => [key, 2, 1]),
  );
  const calls = await dep.calls();
  // Before leg 2: attempts 0 and 1 only; leg 2 makes each rollout's two calls as attempt 2.
  const old = calls.slice(0, seen);
  expect(new Set(old.map((c) => c.attempt))).toEqual(new Set([0, 1]));
  for (const { rollout_id: id } of rows) {
    expect(
      calls
        .slice(seen)
        .filter((c) => c.rollout_id === id)
        .map((c) => c.attempt),
    ).toEqual([2, 2]);
  }
});

/** `npx ckpt-gym …` from the repository root, in its own process group (killed at the end). */
function npx(args: string[]): {
  child: ChildProcess;
  exited: Promise<number | null>;
  output: () => string;
} {
  const child = spawn('npx', ['ckpt-gym', ...args], {
    cwd: REPO,
    detached: true,
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let output = '';
  child.stdout?.on('data', (chunk: Buffer) => (output += chunk.toString()));
  child.stderr?.on('data', (chunk: Buffer) => (output += chunk.toString()));
  const exited = new Promise<number | null>((done) => child.once('exit', (code) => done(code)));
  return { child, exited, output: () => output };
}

scenario(
  'under npx: checkpoint-now checkpoints the collector, and SIGTERM to npx stops it with a checkpoint',
  async () => {
    const dep = await Deployment.start('native');
    const col = new Collection(dep, 'npx', weatherTasks(KEYS));
    await dep.backend('/_ctl/hold', { after_calls_per_rollout: 1 });
    const config = ['--config', dep.handle.configPath];
    const run = npx([...col.args(), ...config]);
    try {
      await dep.waitForCalls(2 * KEYS.length);
      await until(() => col.dir().readPid() !== undefined, 'the collector pid', 30_000);
      const pid = col.dir().readPid()!;
      expect(pid).not.toBe(run.child.pid);

      const now = npx(['checkpoint-now', '--checkpoint-dir', col.checkpointDir, ...config]);
      expect(await now.exited).toBe(0);
      expect(now.output()).toMatch(/checkpoint ckpt-\S+ published/);
      expect(col.published()).toHaveLength(1);

      // npm passes SIGTERM to its shell, which dies without passing it on: the bin notices.
      run.child.kill('SIGTERM');
      await until(
        () => !existsSync(join(col.checkpointDir, 'collector.pid')),
        'the collector to stop',
        60_000,
      );
      expect(col.published()).toHaveLength(2);
      await until(() => !processAlive(pid), 'the collector to exit', 30_000);
      // Its last words (exit 75), still on the pipe npm handed it.
      await until(
        () => /stopped after checkpoint ckpt-/.test(run.output()),
        'the stop summary',
        30_000,
      );
    } finally {
      try {
        process.kill(-run.child.pid!, 'SIGKILL');
      } catch {
        // gone
      }
    }
    await dep.crash();
    await dep.backend('/_ctl/release', {});
    await dep.restart();
    const resumed = dep.cli([...col.args(), '--resume']);
    expect(await resumed.exited).toBe(0);
    expect(
      col
        .rows()
        .map((r) => [taskKey(r.rollout_id), r.attempt])
        .sort(),
    ).toEqual(KEYS.map((key) => [key, 1]));
  },
);
