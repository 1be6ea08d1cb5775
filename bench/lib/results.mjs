/* global process */
// How a benchmark records its figures: bench/results/<name>.json, with the date, the machine and
// the load average it ran under (these machines are shared: the load says how far to trust it).
import { mkdirSync, writeFileSync } from 'node:fs';
import { cpus, loadavg, totalmem } from 'node:os';
import { dirname } from 'node:path';

/** Writes `fields` as the JSON result of `benchmark` to `path`; `loadStart` is loadavg() at start. */
export function writeResult(path, benchmark, loadStart, fields) {
  mkdirSync(dirname(path), { recursive: true });
  const result = {
    benchmark,
    date: new Date().toISOString(),
    load_average: { start: loadStart, end: loadavg() },
    machine: {
      cpus: cpus().length,
      cpu: cpus()[0]?.model,
      memory_gib: totalmem() / 2 ** 30,
      node: process.version,
    },
    ...fields,
  };
  writeFileSync(path, `${JSON.stringify(result, null, 2)}\n`);
}
