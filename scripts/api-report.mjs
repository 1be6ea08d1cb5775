/* global console, process */
// The public API check: api-extractor compares each entry point's declarations with its committed
// report (`packages/*/api/<entry>.api.md`) and fails when they differ, so an API change is always a
// reviewed change to the report. `--update` rewrites the reports instead (run after `npm run build`).
// A type a signature uses must be exported by some entry point of its package (api-extractor checks
// one entry at a time, so a type exported by a sibling entry is fine).
import { existsSync, mkdirSync, readdirSync, readFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { Extractor, ExtractorConfig } from '@microsoft/api-extractor';

const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const update = process.argv.includes('--update');

function exportedNames(dts) {
  const names = new Set();
  for (const list of readFileSync(dts, 'utf8').matchAll(/export (?:type )?\{([^}]*)\}/g)) {
    for (const spec of list[1].split(',')) {
      const name = spec.trim().replace(/^type\s+/, '').split(/\s+as\s+/).pop();
      if (name) names.add(name);
    }
  }
  return names;
}

function checkPackage(dir) {
  const configs = readdirSync(dir)
    .filter((f) => f !== 'base.json')
    .map((f) => ExtractorConfig.loadFileAndPrepare(join(dir, f)));
  const exported = new Set(configs.flatMap((c) => [...exportedNames(c.mainEntryPointFilePath)]));
  for (const c of configs) mkdirSync(c.reportFolder, { recursive: true });
  let failed = 0;
  for (const config of configs) {
    const forgotten = new Set();
    const result = Extractor.invoke(config, {
      localBuild: update,
      messageCallback: (message) => {
        if (message.messageId === 'ae-forgotten-export') {
          const symbol = /"([^"]+)"/.exec(message.text)?.[1];
          if (symbol && !exported.has(symbol)) forgotten.add(symbol);
        }
        message.handled = true; // written into the report; only the outcome is printed
      },
    });
    const name = join(config.reportFolder, config.reportConfigs[0].fileName).slice(repo.length + 1);
    if (forgotten.size > 0) {
      failed += 1;
      console.error(`${name}: signatures use types no entry point exports: ${[...forgotten].join(', ')}`);
    }
    if (result.apiReportChanged && !update) {
      failed += 1;
      console.error(`${name}: the API changed; review it and run \`npm run build && npm run api:update\``);
    } else console.log(`${name}: ${result.apiReportChanged ? 'updated' : 'unchanged'}`);
  }
  return failed;
}

const dirs = readdirSync(join(repo, 'packages'))
  .map((pkg) => join(repo, 'packages', pkg, 'api-extractor'))
  .filter((dir) => existsSync(dir));
const failed = dirs.reduce((n, dir) => n + checkPackage(dir), 0);
process.exit(failed > 0 ? 1 : 0);
