/* global console, process */
// `npm run bench -- <name> [flags]`: runs bench/<name>.mjs against the built packages.
// Each benchmark prints a table and writes JSON under bench/results/. Without a name, lists them.
import { spawnSync } from 'node:child_process';
import { existsSync, readdirSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const benchDir = join(repo, 'bench');
const available = readdirSync(benchDir)
  .filter((f) => f.endsWith('.mjs'))
  .map((f) => f.slice(0, -'.mjs'.length))
  .sort();
const [name, ...args] = process.argv.slice(2);

if (!name || !available.includes(name)) {
  console.error(`usage: npm run bench -- <name> [flags]\nbenchmarks: ${available.join(', ')}`);
  process.exit(name ? 2 : 0);
}
if (!existsSync(join(repo, 'packages/core/dist/api/server.js'))) {
  console.error('the packages are not built: run `npm run build` first');
  process.exit(2);
}
const run = spawnSync(process.execPath, [join(benchDir, `${name}.mjs`), ...args], { stdio: 'inherit' });
process.exit(run.status ?? 1);
