/* global AbortController, console, fetch, performance, process */
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
// 3. Ledger commit and restore at scale (SPEC §7: each ≤ 0.5 s for the whole stack): a capture
//    directory as a run leaves it (per rollout an attempt-1 ledger of 2 delivered rows, its started
//    marker and the attempt-0 fence; 8k rollouts by default), then the model participant's export
//    of attempt 1 of every rollout and its install of a checkpoint of attempt 0 (import under
//    attempt 1, deleting what the dead execution left, and retire of attempt 0).
// Throughput rows are medians of 3 interleaved rounds; compare ratios, which one run measures.
//
//   npm run build && node bench/policy-model.mjs [--requests 3000] [--concurrency 32]
//     [--rollouts 16000] [--ledger-rollouts 8000] [--ledger-only]
//
// Prints a table and writes bench/results/policy-model.json.
import { spawn } from 'node:child_process';
import { mkdirSync, writeFileSync } from 'node:fs';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { cpus, tmpdir, totalmem } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';

import { CaptureLedger, PolicyParticipant } from '@ckpt-gym/policy-model-server';

import { benchFlags } from './lib/flags.mjs';

const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const flags = benchFlags(import.meta.url, {
  options: {
    requests: { type: 'string', default: '3000' },
    concurrency: { type: 'string', default: '32' },
    rollouts: { type: 'string', default: '16000' },
    'ledger-rollouts': { type: 'string', default: '8000' },
    'ledger-only': { type: 'boolean', default: false },
  },
});
const REQUESTS = Number(flags.requests);
const CONCURRENCY = Number(flags.concurrency);
const ROLLOUTS = Number(flags.rollouts);
const LEDGER_ROLLOUTS = Number(flags['ledger-rollouts']);
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
  return start('packages/policy-model-server/bin/ckpt-gym-policy-model.js', [
    '--config',
    file,
    '--server',
    'policy',
  ]);
}

async function throughput(dir) {
  const backend = await start('packages/fake-inference/bin/ckpt-gym-fake-inference.js', [
    '--port',
    '0',
  ]);
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

/** A delivered row shaped like the policy server's (about 1.1 kB encoded). */
function ledgerRow(rolloutId, call) {
  const hex = (seed) => `${seed}`.padEnd(64, 'f').slice(0, 64);
  const id = `${rolloutId}-call-${call}`;
  return {
    model_call_id: id,
    capture_key: rolloutId,
    parent_call_id: call === 0 ? null : `${rolloutId}-call-${call - 1}`,
    prev_len: call * 19,
    delta_len: 19,
    cum_len: (call + 1) * 19,
    weight_version: 7,
    digest: hex(`d${call}${rolloutId}`),
    extras_digest: hex('e'),
    staging_key: `${rolloutId}/${id}`,
    mode: 'text',
    chain_hash: hex(`c${call}${rolloutId}`),
    cumulative_hash: hex(`h${call}${rolloutId}`),
    response_id: `resp_${id}`,
    admitted_at: 1796043536.228,
    started_at: 1796043536.37,
    output_fingerprint: hex(`o${call}`),
    continuation_fingerprint: null,
    fingerprint_version: 1,
    request_digest: hex(`q${call}`),
    prompt_tokens: 9,
    completion_tokens: 10,
    route: 'responses',
    stream: false,
    staging_chain: [`${rolloutId}/${id}`],
    context_len: 2,
    context_digest: hex(`x${call}`),
  };
}

async function restoreBench(dir) {
  const captureDir = join(dir, 'restore');
  const ledger = await new CaptureLedger(captureDir).init();
  const files = [];
  for (let i = 0; i < LEDGER_ROLLOUTS; i++) {
    const r = `scale-${i}`;
    const rows = [ledgerRow(r, 0), ledgerRow(r, 1)];
    files.push(
      [`${r}-a1.lineage.jsonl`, rows.map((row) => `${JSON.stringify(row)}\n`).join('')],
      [`${r}-a1.lineage.started`, ''],
      [`${r}.lineage.retired`, ''],
    );
  }
  for (let i = 0; i < files.length; i += 256) {
    await Promise.all(
      files.slice(i, i + 256).map(([name, text]) => writeFile(join(captureDir, name), text)),
    );
  }
  // Only the calls' bookkeeping is read by export and install; no model calls run here.
  const gate = { marks: undefined, undeliveredCallIds: () => new Set() };
  const participant = new PolicyParticipant('policy', gate, ledger);
  const scope = (attempt) =>
    Array.from({ length: LEDGER_ROLLOUTS }, (_, i) => ({ rollout_id: `scale-${i}`, attempt }));
  const t0 = performance.now();
  const records = await participant.export(scope(1), new AbortController().signal);
  const exportSeconds = (performance.now() - t0) / 1000;
  const restored = records.map((r) => ({ ...r, episode_id: { ...r.episode_id, attempt: 0 } }));
  const t1 = performance.now();
  await participant.install(restored, scope(0));
  const installSeconds = (performance.now() - t1) / 1000;
  return {
    rollouts: LEDGER_ROLLOUTS,
    rows_exported: records.reduce((n, r) => n + r.rows.length, 0),
    export_seconds: exportSeconds,
    install_seconds: installSeconds,
    target_export_seconds: 0.15,
    target_install_seconds: 0.25,
  };
}

function byRollout(targets) {
  const rollouts = new Map();
  for (const key of targets.keys()) rollouts.set(key.replace(/-a[1-9][0-9]*$/, ''), true);
  return rollouts;
}

const dir = await mkdtemp(join(tmpdir(), 'bench-policy-'));
try {
  const rows = flags['ledger-only'] ? [] : await throughput(dir);
  const cleanup = await cleanupBench(dir);
  const restore = await restoreBench(dir);
  if (rows.length > 0)
    console.log(`chat completions: ${REQUESTS} requests, concurrency ${CONCURRENCY}`);
  if (rows.length > 0)
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
  console.log(`ledger commit and restore: ${restore.rollouts} rollouts, 2 rows each`);
  console.table({
    'export (s)': restore.export_seconds.toFixed(3),
    'install: import + retire of attempt 0 (s)': restore.install_seconds.toFixed(3),
  });
  // A ledger-only run leaves the full results file alone.
  if (!flags['ledger-only']) {
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
          ledger_restore: restore,
        },
        null,
        2,
      )}\n`,
    );
  }
} finally {
  for (const child of children) child.kill('SIGTERM');
  await rm(dir, { recursive: true, force: true });
}
