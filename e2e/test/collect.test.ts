/**
 * Rollout collection (`ckpt-gym run`) against a real stack: SIGUSR1 checkpoints and goes on;
 * SIGTERM checkpoints and exits 75, and `--resume` after a crash of every gym process finishes
 * every rollout exactly once.
 */
import { until } from '@ckpt-gym/testing';
import { existsSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { weatherEpisode } from './support/stacks.js';

afterEach(closeAll);

const ROLLOUTS = ['col-1', 'col-2', 'col-3', 'col-4'];

interface ResultRow {
  rollout_id: string;
  attempt: number;
  result: { reward?: number } | null;
  failure: unknown;
}

/** A rollout id without its run's prefix: the task's own key. */
const taskKey = (rolloutId: string) => rolloutId.slice(rolloutId.indexOf('.') + 1);

function writeTasks(dep: Deployment): string {
  const path = join(dep.runDir, 'tasks.jsonl');
  const lines = ROLLOUTS.map((id) => {
    const { task } = weatherEpisode(id) as { task: Record<string, unknown> };
    return JSON.stringify({ rollout_id: id, ...task });
  });
  writeFileSync(path, `${lines.join('\n')}\n`);
  return path;
}

function runArgs(dep: Deployment, extra: string[] = []): string[] {
  return [
    'run',
    '--input',
    writeTasks(dep),
    '--output',
    join(dep.runDir, 'results.jsonl'),
    '--checkpoint-dir',
    join(dep.runDir, 'collection-ckpt'),
    '--concurrency',
    String(ROLLOUTS.length),
    ...extra,
  ];
}

function results(dep: Deployment): ResultRow[] {
  const path = join(dep.runDir, 'results.jsonl');
  if (!existsSync(path)) return [];
  return readFileSync(path, 'utf8')
    .split('\n')
    .filter(Boolean)
    .map((line) => JSON.parse(line) as ResultRow);
}

/** Checkpoints published by the collection (directories with a collection.json). */
function published(dep: Deployment): string[] {
  const dir = join(dep.runDir, 'collection-ckpt');
  if (!existsSync(dir)) return [];
  return readdirSync(dir).filter((name) => existsSync(join(dir, name, 'collection.json')));
}

scenario('SIGUSR1 takes a checkpoint and the collection goes on', async () => {
  const dep = await Deployment.start('native');
  await dep.backend('/_ctl/hold', { after_calls_per_rollout: 1 });
  const run = dep.cli(runArgs(dep));
  await dep.waitForCalls(2 * ROLLOUTS.length);
  run.child.kill('SIGUSR1');
  await until(() => published(dep).length === 1, 'the SIGUSR1 checkpoint', 30_000);
  await dep.backend('/_ctl/release', {});
  expect(await run.exited).toBe(0);
  const rows = results(dep);
  expect(rows.map((r) => taskKey(r.rollout_id)).sort()).toEqual(ROLLOUTS);
  expect(rows.every((r) => r.result?.reward === 1 && r.attempt === 0)).toBe(true);
  expect(await dep.callCount()).toBe(2 * ROLLOUTS.length);
});

scenario(
  'SIGTERM checkpoints and exits 75; --resume after a crash finishes every rollout exactly once',
  async () => {
    const dep = await Deployment.start('native');
    await dep.backend('/_ctl/hold', { after_calls_per_rollout: 1 });
    const first = dep.cli(runArgs(dep));
    await dep.waitForCalls(2 * ROLLOUTS.length);
    first.child.kill('SIGTERM');
    expect(await first.exited).toBe(75);
    expect(published(dep)).toHaveLength(1);
    expect(results(dep)).toEqual([]);

    await dep.crash();
    await dep.backend('/_ctl/release', {});
    await dep.restart();
    const second = dep.cli(runArgs(dep, ['--resume']));
    expect(await second.exited).toBe(0);

    const rows = results(dep);
    expect(rows.map((r) => taskKey(r.rollout_id)).sort()).toEqual(ROLLOUTS);
    expect(rows.every((r) => r.result?.reward === 1 && r.attempt === 1)).toBe(true);
    // Each rollout: its first call delivered before the checkpoint, its second (held) never
    // delivered; the continued attempt makes that second call once.
    const calls = await dep.calls();
    for (const { rollout_id: id } of rows) {
      expect(calls.filter((c) => c.rollout_id === id).map((c) => c.n_messages)).toEqual([2, 4, 4]);
    }
  },
);
