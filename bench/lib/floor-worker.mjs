/* global process, performance */
// One participant's share of the restore floor (see floor.mjs): the least work its restore of a
// checkpoint could do, in a fresh process as after a crash, timed from the parent's "go": read the
// records file, SHA-256 it, JSON.parse every line (kept, as a restore keeps what it validated);
// then, for each ledger key, the least per-key capture-ledger install: fence the continued attempt
// by a hard link, rename its ledger to its replacement's name, overwrite it (open, write, close).
//
//   node floor-worker.mjs <records file> <scratch dir> <ledger keys>
//
// Prints one JSON line: wall and CPU milliseconds, and wall milliseconds per step.
import { createHash } from 'node:crypto';
import fs from 'node:fs';
import { join } from 'node:path';

const [recordsPath, scratch, ledgerKeysArg] = process.argv.slice(2);
const ledgerKeys = Number(ledgerKeysArg);
const ledgerDir = join(scratch, 'ledger');
fs.mkdirSync(ledgerDir, { recursive: true });

// Ledger files as a dead execution leaves them, one row of the checkpoint's average size each.
const recordsBytes = fs.statSync(recordsPath).size;
const rowText = 'x'.repeat(Math.max(1, Math.floor(recordsBytes / Math.max(1, ledgerKeys)) - 1));
fs.writeFileSync(join(ledgerDir, '.fence'), '');
for (let i = 0; i < ledgerKeys; i++) {
  fs.writeFileSync(join(ledgerDir, `k-${i}-a0.lineage.jsonl`), `${rowText}\n`);
}

const steps = {};
let lap = 0;
function step(name) {
  const at = performance.now();
  steps[name] = Math.round(at - lap);
  lap = at;
}

function restore() {
  const buffer = fs.readFileSync(recordsPath);
  step('read');
  createHash('sha256').update(buffer).digest('hex');
  step('sha256');
  const records = [];
  let start = 0;
  for (let end = buffer.indexOf(10); end !== -1; end = buffer.indexOf(10, start)) {
    records.push(JSON.parse(buffer.toString('utf8', start, end)));
    start = end + 1;
  }
  step('parse');
  const stamped = `${rowText}..\n`;
  for (let i = 0; i < ledgerKeys; i++) {
    fs.linkSync(join(ledgerDir, '.fence'), join(ledgerDir, `k-${i}-a0.lineage.retired`));
    const target = join(ledgerDir, `k-${i}-a1.lineage.jsonl`);
    fs.renameSync(join(ledgerDir, `k-${i}-a0.lineage.jsonl`), target);
    const fd = fs.openSync(target, 'r+');
    fs.writeSync(fd, stamped, 0);
    fs.closeSync(fd);
  }
  if (ledgerKeys > 0) step('ledger');
  return records.length;
}

process.stdin.once('data', () => {
  const started = performance.now();
  lap = started;
  const cpu = process.cpuUsage();
  const records = restore();
  const spent = process.cpuUsage(cpu);
  process.stdout.write(
    `${JSON.stringify({
      records,
      wall_ms: Math.round(performance.now() - started),
      cpu_ms: Math.round((spent.user + spent.system) / 1000),
      steps_ms: steps,
    })}\n`,
  );
  process.stdin.destroy();
});
process.stdout.write('ready\n');
