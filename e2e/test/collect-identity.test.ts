/**
 * A collection has an identity: two runs of the same tasks back to back share no rollout id and
 * no capture ledger row, and every capture is clean; an output of another run is refused.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';

import { Collection, taskKey, weatherTasks } from './collect-kit.js';
import { closeAll, Deployment, scenario } from './support/deployment.js';

afterEach(closeAll);

const KEYS = ['t1', 't2', 't3'];

/** Ledger file name → its lineage rows. */
function ledgers(dep: Deployment): Map<string, Record<string, unknown>[]> {
  const dir = join(dep.runDir, 'capture');
  const out = new Map<string, Record<string, unknown>[]>();
  for (const name of readdirSync(dir).filter((n) => n.endsWith('.lineage.jsonl'))) {
    const rows = readFileSync(join(dir, name), 'utf8').split('\n').filter(Boolean);
    out.set(
      name,
      rows.map((line) => JSON.parse(line) as Record<string, unknown>),
    );
  }
  return out;
}

scenario(
  'two runs of the same tasks: no shared rollout id, no lineage row of one in the other, clean captures',
  async () => {
    const dep = await Deployment.start('native', { tokenCapture: true });
    const first = new Collection(dep, 'first', weatherTasks(KEYS));
    const second = new Collection(dep, 'second', weatherTasks(KEYS));
    expect(await dep.cli(first.args()).exited).toBe(0);
    expect(await dep.cli(second.args()).exited).toBe(0);

    const [a, b] = [first.rows(), second.rows()];
    for (const rows of [a, b]) {
      expect(rows.map((r) => taskKey(r.rollout_id)).sort()).toEqual(KEYS);
      expect(new Set(rows.map((r) => r.run_id)).size).toBe(1);
      expect(rows.every((r) => r.result?.reward === 1 && r.capture_failures === undefined)).toBe(
        true,
      );
      for (const r of rows) expect(r.rollout_id).toBe(`${r.run_id}.${taskKey(r.rollout_id)}`);
    }
    expect(a[0]!.run_id).not.toBe(b[0]!.run_id);
    const idsA = new Set(a.map((r) => r.rollout_id));
    expect(b.filter((r) => idsA.has(r.rollout_id))).toEqual([]);

    // Every ledger belongs to one rollout of one run, holds its two calls, and no failure.
    const all = ledgers(dep);
    const ids = [...a, ...b].map((r) => r.rollout_id).sort();
    expect([...all.keys()].map((name) => name.replace('.lineage.jsonl', '')).sort()).toEqual(ids);
    for (const [name, rows] of all) {
      expect([name, rows.length, rows.filter((r) => r.failure_reason !== undefined)]).toEqual([
        name,
        2,
        [],
      ]);
    }
  },
);

scenario('an output of another run is refused, with or without --resume', async () => {
  const dep = await Deployment.start('native');
  const first = new Collection(dep, 'first', weatherTasks(['t1']));
  const other = new Collection(dep, 'other', weatherTasks(['t1']));
  expect(await dep.cli(first.args()).exited).toBe(0);
  expect(await dep.cli(other.args()).exited).toBe(0);

  // Again into the same output: a new run would mix its rows with the old run's.
  const again = dep.cli(first.args());
  expect(await again.exited).toBe(1);
  expect(again.output()).toMatch(
    /already holds 1 outcome\(s\) of run run-.*: finish that run with --resume/,
  );
  // One run's output with another run's directory.
  const mixed = dep.cli([...first.args(), '--checkpoint-dir', other.checkpointDir, '--resume']);
  expect(await mixed.exited).toBe(1);
  expect(mixed.output()).toContain(`is run ${other.rows()[0]!.run_id}'s`);
  expect(first.rows()).toHaveLength(1);
});

scenario('--resume with more tasks than the output holds sends the new ones', async () => {
  const dep = await Deployment.start('native');
  const run = new Collection(dep, 'grow', weatherTasks(['t1']));
  expect(await dep.cli(run.args()).exited).toBe(0);
  const grown = new Collection(dep, 'grow', weatherTasks(['t1', 't2', 't3']));
  const resumed = dep.cli([...grown.args(), '--resume']);
  expect(await resumed.exited).toBe(0);
  expect(resumed.output()).toMatch(/2 outcome\(s\) written .*; 3\/3 finished/);
  expect(
    run
      .rows()
      .map((r) => taskKey(r.rollout_id))
      .sort(),
  ).toEqual(['t1', 't2', 't3']);
});
