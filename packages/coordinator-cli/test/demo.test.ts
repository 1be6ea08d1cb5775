/** The demo end to end with 4 rollouts: spawned processes, a real crash, a real restore. */
import { spawn } from 'node:child_process';
import { mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { type DemoReport, ExitCode, repeatedCalls } from '../src/index.js';
import { ensureBuilt, REPO } from './support/build.js';
import { cli } from './support/cli.js';

beforeAll(() => ensureBuilt(), 300_000);

test('the demo finishes every rollout exactly once with reward 1 and repeats no delivered model call', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-demo-test-'));
  try {
    // --run-dir keeps the work directory; the demo stops its stack itself, whatever happened.
    const run = await cli(['demo', '--rollouts', '4', '--run-dir', 'work', '--json'], dir);
    expect(run.stderr).toMatch(/SIGKILL every gym process/);
    const report = run.json() as unknown as DemoReport & { exit_code: number };
    expect(report).toMatchObject({
      exit_code: ExitCode.OK,
      ok: true,
      rollouts: 4,
      tasksets: { weather: 2, counter: 2 },
      finished_before_checkpoint: 1,
      continued: 3,
      restarted: 0,
      repeated_model_calls: 0,
      not_exactly_once: [],
      rewards: { '1': 4 },
      minimum_model_calls: 10,
      delivered_model_calls: 10,
    });
    // Weather needs 2 calls, counter 3. The three calls held at the crash were dropped unanswered
    // and made again by the replacements.
    expect(report.model_calls).toBe(13);
    expect(readdirSync(join(dir, 'work', 'checkpoint'))).toContain('controller.json');
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}, 180_000);

test('a delivered model call made again for the same rollout and conversation counts as repeated', () => {
  const call = { rollout_id: 'r', n_messages: 2, held: false, returned: true, dropped: false };
  expect(repeatedCalls([call, { ...call, returned: false, dropped: true }])).toBe(0);
  expect(repeatedCalls([call, { ...call, n_messages: 4 }])).toBe(0);
  expect(repeatedCalls([call, call])).toBe(1);
});

/** The README's machine-readable demo command, from the repository root, as a real process. */
const MACHINE_READABLE_DEMO = ['npx', 'ckpt-gym', 'demo', '--rollouts', '8', '--json'];

test(`\`${MACHINE_READABLE_DEMO.join(' ')}\` prints exactly one JSON document on stdout`, async () => {
  const [command = '', ...args] = MACHINE_READABLE_DEMO;
  const child = spawn(command, args, { cwd: REPO, stdio: ['ignore', 'pipe', 'pipe'] });
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (chunk: Buffer) => (stdout += chunk.toString()));
  child.stderr.on('data', (chunk: Buffer) => (stderr += chunk.toString()));
  const code = await new Promise<number | null>((done) => child.on('close', done));
  // stderr (the progress) is part of the expectation only when the command failed: to show why.
  expect({ code, stderr: code === 0 ? '' : stderr }).toEqual({ code: 0, stderr: '' });
  // The whole of stdout, as `| jq` would read it: no banner, no build log, no progress line.
  expect(JSON.parse(stdout)).toMatchObject({ command: 'demo', ok: true, rollouts: 8 });
  expect(stderr).toMatch(/SIGKILL every gym process/);
}, 180_000);
