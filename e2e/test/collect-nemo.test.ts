/**
 * NeMo Gym rows through `run`, against both environment apps: the rows of a NeMo Gym-format JSONL
 * (examples/nemo-weather.jsonl, written from NeMo Gym's documented format) go in unchanged, with
 * `--num-repeats` and `--limit`; NeMo-shaped rows come out, and a failed episode goes to the
 * `<stem>_failures.jsonl` sidecar tagged `_ng_failure_class`.
 */
import { readFileSync } from 'node:fs';
import { join, resolve } from 'node:path';

import { Collection } from './collect-kit.js';
import { closeAll, Deployment, scenario } from './support/deployment.js';
import type { StackShape } from './support/stacks.js';

afterEach(closeAll);

const FIXTURE = resolve(import.meta.dirname, '../../examples/nemo-weather.jsonl');
/** A row the agent cannot run: its create params carry an input no model takes. */
const BROKEN_ROW = JSON.stringify({
  responses_create_params: { input: 42 },
  agent_ref: { name: 'simple_agent' },
  expected_city: 'Nowhere',
});

interface NemoRow {
  reward?: number;
  response?: unknown;
  expected_city?: string;
  agent_ref?: { name: string };
  _ng_task_index: number;
  _ng_rollout_index: number;
  _ng_rollout_id: string;
  _ng_run_id: string;
  _ng_failure_class?: string;
  responses_create_params?: unknown;
  result?: unknown;
}

describe.each([
  ['native', 'single_agent_turn'],
  ['legacy', 'single_agent_turn_legacy'],
] as [StackShape, string][])('NeMo Gym rows through %s (%s)', (shape) => {
  scenario('rows in, NeMo-shaped rows and a failures sidecar out', async () => {
    const dep = await Deployment.start(shape);
    const input = `${readFileSync(FIXTURE, 'utf8').trimEnd()}\n${BROKEN_ROW}\n`;
    const col = new Collection(dep, 'nemo', input);
    // --limit 3 keeps the broken row out; a second collection takes it.
    const run = dep.cli(col.args(['--num-repeats', '2', '--limit', '3']));
    expect(await run.exited).toBe(0);

    const rows = col.rows<NemoRow>();
    const indices = rows.map((r) => [r._ng_task_index, r._ng_rollout_index]).sort();
    expect(indices).toEqual(
      [0, 1, 2].flatMap((t) => [
        [t, 0],
        [t, 1],
      ]),
    );
    const runId = rows[0]!._ng_run_id;
    for (const row of rows) {
      // The flat /run reply, not wrapped: reward, the response, the verifier's field.
      expect(row).toMatchObject({ reward: 1, agent_ref: { name: 'simple_agent' } });
      expect(row.response).toBeDefined();
      expect(row.result).toBeUndefined();
      expect(typeof row.expected_city).toBe('string');
      expect(row._ng_rollout_id).toBe(`${runId}.${row._ng_task_index}-${row._ng_rollout_index}`);
      expect(row._ng_failure_class).toBeUndefined();
    }
    expect(col.failures()).toEqual([]);

    const broken = new Collection(dep, 'broken', `${BROKEN_ROW}\n`);
    const second = dep.cli(broken.args(['--format', 'nemo']));
    expect(await second.exited).toBe(0);
    expect(broken.rows()).toEqual([]);
    const failures = broken.failures<NemoRow>();
    expect(failures).toHaveLength(1);
    expect(failures[0]).toMatchObject({
      _ng_failure_class: 'environment_server_failed',
      _ng_task_index: 0,
      _ng_rollout_index: 0,
    });
    expect(second.output()).toContain(
      `1 of them failures (in ${join(dep.runDir, 'broken.results_failures.jsonl')})`,
    );
  });
});
