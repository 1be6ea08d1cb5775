/* global console, process */
// `npm test`: every package's tests through turbo, then one closing line with the totals.
// Fails when any test failed, when a package's run failed, or when no test ran at all.
import { spawnSync } from 'node:child_process';
import { existsSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const resultsDir = join(repo, '.test-results');
rmSync(resultsDir, { recursive: true, force: true });

const turbo = spawnSync('npx', ['turbo', 'run', 'test', '--concurrency=1', ...process.argv.slice(2)], {
  cwd: repo,
  stdio: 'inherit',
  env: { ...process.env, TURBO_TELEMETRY_DISABLED: '1' },
});

let passed = 0;
let failed = 0;
let skipped = 0;
if (existsSync(resultsDir)) {
  for (const file of readdirSync(resultsDir)) {
    const r = JSON.parse(readFileSync(join(resultsDir, file), 'utf8'));
    passed += r.numPassedTests;
    failed += r.numFailedTests;
    skipped += r.numPendingTests + (r.numTodoTests ?? 0);
    failed += r.numRuntimeErrorTestSuites;
  }
}
console.log(`\ntests: ${passed} passed, ${failed} failed, ${skipped} skipped`);
if (turbo.status !== 0 || failed > 0 || passed === 0) {
  if (passed === 0) console.error('no test ran');
  process.exit(1);
}
