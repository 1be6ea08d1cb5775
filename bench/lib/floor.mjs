/* global process */
// The restore floor of a checkpoint: the least work each participant's restore of it could do
// (floor-worker.mjs), all participants at once in fresh processes, as after a crash. The restore
// measured on this machine is compared with its floor, measured in the same run: a target below the
// floor cannot be met by any implementation that keeps the checkpoint's format (and, for the floor
// with the ledger, one capture-ledger file per key).
import { spawn } from 'node:child_process';
import { mkdtemp, readdir, readFile, rm } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const WORKER = join(dirname(fileURLToPath(import.meta.url)), 'floor-worker.mjs');

/** `{ participant: { path, records } }` for every records file under a checkpoint's gym directory. */
async function recordsFiles(gymDir) {
  const files = {};
  for (const kind of await readdir(gymDir)) {
    for (const instance of await readdir(join(gymDir, kind))) {
      const dir = join(gymDir, kind, instance);
      const manifest = JSON.parse(await readFile(join(dir, 'manifest.json'), 'utf8'));
      files[`${kind}/${instance}`] = {
        kind,
        path: join(dir, manifest.records_file),
        records: manifest.record_count,
      };
    }
  }
  return files;
}

function startWorker(args) {
  const child = spawn(process.execPath, [WORKER, ...args], { stdio: ['pipe', 'pipe', 'inherit'] });
  let out = '';
  const ready = new Promise((resolve, reject) => {
    child.stdout.on('data', (chunk) => {
      out += chunk;
      if (out.startsWith('ready\n')) resolve();
    });
    child.on('exit', (code) =>
      reject(new Error(`floor worker exited ${code} before it was ready`)),
    );
  });
  const done = new Promise((resolve, reject) =>
    child.on('exit', (code) => {
      const line = out.split('\n').find((l) => l.startsWith('{'));
      if (code === 0 && line) resolve(JSON.parse(line));
      else reject(new Error(`floor worker exited ${code}: ${out}`));
    }),
  );
  done.catch(() => undefined);
  return { child, ready, done };
}

/**
 * One measurement: a worker per participant, started together once all are ready. `ledger` gives
 * the model participant the per-key capture-ledger work of one key per record. Wall is the slowest
 * participant's, CPU the sum.
 */
async function measureOnce(files, ledger, scratchRoot) {
  const scratch = await mkdtemp(join(scratchRoot, 'floor-'));
  const workers = [];
  try {
    for (const [name, file] of Object.entries(files)) {
      const keys = ledger && file.kind === 'model' ? file.records : 0;
      const dir = join(scratch, name.replace('/', '-'));
      workers.push({ name, ...startWorker([file.path, dir, String(keys)]) });
    }
    await Promise.all(workers.map((w) => w.ready));
    for (const w of workers) w.child.stdin.write('go\n');
    const results = await Promise.all(workers.map((w) => w.done));
    const by = Object.fromEntries(workers.map((w, i) => [w.name, results[i]]));
    return {
      wall_ms: Math.max(...results.map((r) => r.wall_ms)),
      cpu_ms: results.reduce((sum, r) => sum + r.cpu_ms, 0),
      by_participant: by,
    };
  } finally {
    for (const w of workers) w.child.kill('SIGKILL');
    await rm(scratch, { recursive: true, force: true });
  }
}

/** The median (by wall time) of `repeats` measurements of the restore floor of `gymDir`. */
export async function restoreFloor(gymDir, { ledger, scratchRoot, repeats = 3 }) {
  const files = await recordsFiles(gymDir);
  const runs = [];
  for (let i = 0; i < repeats; i++) runs.push(await measureOnce(files, ledger, scratchRoot));
  runs.sort((a, b) => a.wall_ms - b.wall_ms);
  return { ...runs[Math.floor(runs.length / 2)], walls_ms: runs.map((r) => r.wall_ms) };
}
