/**
 * Opt-in: `CKPT_GYM_SCALE=<rollouts>` runs the scale benchmark (bench/scale.mjs, built packages)
 * and checks its contract: every rollout either finished before the checkpoint or was exported,
 * never both, and every exported rollout finished with reward 1.0 after the restore.
 */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';

const rollouts = Number(process.env.CKPT_GYM_SCALE ?? 0);
const maybe = rollouts > 0 ? it : it.skip;

interface ScaleResult {
  scale: number;
  finished_before: number;
  exported: number;
  continued: number;
  finished_and_exported: number;
  neither_finished_nor_exported: number;
}

maybe(
  `every one of ${rollouts} rollouts in flight either finished before the checkpoint or continued after it`,
  () => {
    const dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-e2e-scale-'));
    try {
      const out = join(dir, 'scale.json');
      const bench = resolve(import.meta.dirname, '../../bench/scale.mjs');
      const run = spawnSync(
        process.execPath,
        [bench, '--rollouts', String(rollouts), '--out', out],
        {
          stdio: 'inherit',
          timeout: 1_700_000,
        },
      );
      expect(run.status).toBe(0);
      const result = JSON.parse(readFileSync(out, 'utf8')) as ScaleResult;
      expect(result.scale).toBe(rollouts);
      expect(result.finished_and_exported).toBe(0);
      expect(result.neither_finished_nor_exported).toBe(0);
      expect(result.finished_before + result.exported).toBe(rollouts);
      expect(result.continued).toBe(result.exported);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  },
  1_800_000,
);
