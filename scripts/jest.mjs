/* global process */
// Runs jest for the package in the current directory with native ESM, and writes its JSON results
// under <repo>/.test-results/ so scripts/run-tests.mjs can report one total for the whole repo.
import { spawnSync } from 'node:child_process';
import { mkdirSync, readFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const pkg = JSON.parse(readFileSync('package.json', 'utf8'));
const resultsDir = join(repo, '.test-results');
mkdirSync(resultsDir, { recursive: true });
const outputFile = join(resultsDir, `${pkg.name.replace(/[@/]/g, '_')}.json`);

const result = spawnSync(
  process.execPath,
  [
    '--experimental-vm-modules',
    '--disable-warning=ExperimentalWarning',
    join(repo, 'node_modules/jest/bin/jest.js'),
    '--json',
    `--outputFile=${outputFile}`,
    ...process.argv.slice(2),
  ],
  { stdio: 'inherit' },
);
process.exit(result.status ?? 1);
