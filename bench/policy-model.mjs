/* global console, fetch, performance, process */
// Policy model benchmark.
//
// 1. Throughput and latency of chat completions through the policy model proxy against the fake
//    backend, each a separate process: the backend called directly, the proxy with checkpointing
//    off, with checkpointing on (the policy gate), and with the gate plus the capture ledger (one
//    fsynced row per call). The gate's overhead is reported as a ratio to the direct backend and
//    to the proxy without checkpointing, measured in the same run.
// 2. Ledger cleanup at restore: import empty ledgers for 16k rollouts into a capture directory of
//    96k files (6 per rollout), which deletes what dead executions left for the target attempt and
//    every later one (5 of the 6 files). Reported twice: the listing indexed by rollout (what the
//    Python implementation's 0.23 s measures: it replaced a rescan per rollout), and the whole
//    import with its per-rollout locks, 80k unlinks and one directory sync.
// Throughput rows are medians of 3 interleaved rounds; compare ratios, which one run measures.
//
//   npm run build && node bench/policy-model.mjs [--requests 3000] [--concurrency 32]
//     [--rollouts 16000]
//
// Prints a table and writes bench/results/policy-model.json.
import { spawn } from 'node:child_process';
import { mkdirSync, writeFileSync } from 'node:fs';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { cpus, tmpdir, totalmem } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

import { CaptureLedger } from '@ckpt-gym/policy-model-server';

const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const { values: flags } = parseArgs({
  options: {
    requests: { type: 'string', default: '3000' },
    concurrency: { type: 'string', default: '32' },
    rollouts: { type: 'string', default: '16000' },
  },
});
const REQUESTS = Number(flags.requests);
const CONCURRENCY = Number(flags.concurrency);
const ROLLOUTS = Number(flags.rollouts);
const FILES_PER_ROLLOUT = 6;
const WARMUP = 200;
const ROUNDS = 3;

const children = [];

/** Spawns a node process and resolves with the `url` of its JSON listening line. */
async function start(script, args) {
  const child = spawn(process.execPath, [join(repo, script), ...args], {
    stdio: ['ignore', 'pipe', 'inherit'],
    env: { ...process.env, CKPT_GYM_LOG_LEVEL: 'error' },
  });
  children.push(child);
  for await (const line of createInterface({ input: child.stdout })) {
    const event = JSON.parse(line);
    if (event.event === 'listening') return event.url;
  }
  throw new Error(`${script} exited before listening`);
}

const body = JSON.stringify({
  model: 'fake-model',
  messages: [{ role: 'user', content: 'What is the weather in SF?' }],
});

async function oneCall(url, i) {
  const t0 = performance.now();
  const res = await fetch(`${url}/ng-rollout/bench-${i % 512}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body,
  });
  await res.arrayBuffer();
  if (res.status !== 200) throw new Error(`HTTP ${res.status} from ${url}`);
  return performance.now() - t0;
}

async function load(url, requests) {
  const latencies = [];
  let next = 0;
  const t0 = performance.now();
  const worker = async () => {
    while (next < requests) latencies.push(await oneCall(url, next++));
  };
  await Promise.all(Array.from({ length: CONCURRENCY }, worker));
  const seconds = (performance.now() - t0) / 1000;
  latencies.sort((a, b) => a - b);
  const pct = (p) => latencies[Math.min(latencies.length - 1, Math.floor(p * latencies.length))];
  return { rps: requests / seconds, p50_ms: pct(0.5), p99_ms: pct(0.99) };
}

async function proxyStack(dir, backend, { checkpoint, capture }) {
  const file = join(dir, `stack-${checkpoint}-${capture}.yaml`);
  await writeFile(
    file,
    [
      `checkpoint: { enabled: ${checkpoint}, control_auth_token: bench }`,
      `token_capture: { enabled: ${capture}, dir: ${JSON.stringify(join(dir, `capture-${checkpoint}-${capture}`))} }`,
      'servers:',
      `  policy: { kind: model, app: policy, port: 0, backend_url: "${backend}/v1", checkpoint_policy: true }`,
    ].join('\n'),
  );
  return start('packages/policy-model-server/dist/main.js', [
    '--config',
    file,
    '--server',
    'policy',
  ]);
}

async function throughput(dir) {
  const backend = await start('packages/fake-inference/dist/main.js', ['--port', '0']);
  const targets = [
    ['backend directly', backend],
    [
      'proxy, checkpointing off',
      await proxyStack(dir, backend, { checkpoint: false, capture: false }),
    ],
    [
      'proxy, checkpointing on (gate)',
      await proxyStack(dir, backend, { checkpoint: true, capture: false }),
    ],
    [
      'proxy, gate + capture ledger',
      await proxyStack(dir, backend, { checkpoint: true, capture: true }),
    ],
  ];
  for (const [, url] of targets) await load(url, WARMUP);
  // Interleaved rounds, so a busy spell on a shared machine hits every target alike.
  const rounds = targets.map(() => []);
  for (let round = 0; round < ROUNDS; round++) {
    for (const [i, [, url]] of targets.entries())
      rounds[i].push(await load(url, Math.ceil(REQUESTS / ROUNDS)));
  }
  const median = (values) => values.sort((a, b) => a - b)[Math.floor(values.length / 2)];
  const rows = targets.map(([name], i) => ({
    name,
    rps: median(rounds[i].map((r) => r.rps)),
    p50_ms: median(rounds[i].map((r) => r.p50_ms)),
    p99_ms: median(rounds[i].map((r) => r.p99_ms)),
  }));
  const direct = rows[0].rps;
  const off = rows[1].rps;
  for (const row of rows) {
    row.ratio_to_direct = row.rps / direct;
    row.ratio_to_checkpointing_off = row.rps / off;
  }
  return rows;
}

async function cleanupBench(dir) {
  const captureDir = join(dir, 'cleanup');
  const ledger = await new CaptureLedger(captureDir).init();
  const names = [];
  for (let i = 0; i < ROLLOUTS; i++) {
    const r = `roll-${i}`;
    names.push(
      `${r}.lineage.retired`,
      `${r}-a1.lineage.jsonl`,
      `${r}-a1.tokens.jsonl`,
      `${r}-a2.lineage.jsonl`,
      `${r}-a2.lineage.retired`,
      `${r}-a2.tokens.incomplete`,
    );
  }
  for (let i = 0; i < names.length; i += 256) {
    await Promise.all(names.slice(i, i + 256).map((n) => writeFile(join(captureDir, n), '{}\n')));
  }
  const targets = new Map();
  for (let i = 0; i < ROLLOUTS; i++) targets.set(`roll-${i}-a1`, []);
  const t0 = performance.now();
  const index = await ledger.listByRollout(targets.size === 0 ? new Map() : byRollout(targets));
  const indexSeconds = (performance.now() - t0) / 1000;
  const indexed = [...index.values()].reduce((n, files) => n + files.length, 0);
  const t1 = performance.now();
  await ledger.importMany(targets);
  const importSeconds = (performance.now() - t1) / 1000;
  return {
    rollouts: ROLLOUTS,
    files: ROLLOUTS * FILES_PER_ROLLOUT,
    files_indexed: indexed,
    index_seconds: indexSeconds,
    import_seconds: importSeconds,
    target_seconds: 0.2,
  };
}

function byRollout(targets) {
  const rollouts = new Map();
  for (const key of targets.keys()) rollouts.set(key.replace(/-a[1-9][0-9]*$/, ''), true);
  return rollouts;
}

const dir = await mkdtemp(join(tmpdir(), 'bench-policy-'));
try {
  const rows = await throughput(dir);
  const cleanup = await cleanupBench(dir);
  console.log(`chat completions: ${REQUESTS} requests, concurrency ${CONCURRENCY}`);
  console.table(
    rows.map((r) => ({
      target: r.name,
      'req/s': Math.round(r.rps),
      'p50 ms': r.p50_ms.toFixed(2),
      'p99 ms': r.p99_ms.toFixed(2),
      'vs direct': r.ratio_to_direct.toFixed(2),
      'vs ckpt off': r.ratio_to_checkpointing_off.toFixed(2),
    })),
  );
  console.log(`ledger cleanup: ${cleanup.rollouts} rollouts over ${cleanup.files} files`);
  console.table({
    'listing + index by rollout (s)': cleanup.index_seconds.toFixed(3),
    'whole import: index, locks, deletes, one dir sync (s)': cleanup.import_seconds.toFixed(3),
  });
  const out = join(repo, 'bench/results/policy-model.json');
  mkdirSync(dirname(out), { recursive: true });
  writeFileSync(
    out,
    `${JSON.stringify(
      {
        machine: {
          cpus: cpus().length,
          memory_gib: Math.round(totalmem() / 2 ** 30),
          node: process.version,
        },
        requests: REQUESTS,
        concurrency: CONCURRENCY,
        throughput: rows,
        ledger_cleanup: cleanup,
      },
      null,
      2,
    )}\n`,
  );
} finally {
  for (const child of children) child.kill('SIGTERM');
  await rm(dir, { recursive: true, force: true });
}
