/* global console, performance */
// Throughput: the whole native stack (fake backend with no latency, policy model, weather
// resources, Simple Agent, single_agent_turn environment, each its own process started by the
// CLI's launcher) running N weather rollouts through the environment's /run, C at a time, in four
// stacks: checkpointing off and on, token capture off and on. Per stack: rollouts per second,
// end-to-end latency percentiles, and each server's CPU per rollout (where the time goes, hop by
// hop: environment, agent, policy, resources). The figure that matters is the ratio of "on" to
// "off" in one run: the gate's overhead.
//
//   npm run build && npm run bench -- throughput [--rollouts 2000] [--concurrency 64]
//
// --rounds R runs the four stacks R times, in reversed order every other round (the machine's load
// drifts), and reports each stack's median round by rollouts per second.
// Prints a table and writes bench/results/throughput.json (or --out).
import { writeFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { loadavg, tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

import { freePort, launchStack } from '@ckpt-gym/coordinator-cli';
import { createHttpClients } from '@ckpt-gym/core/client';

import { writeResult } from './lib/results.mjs';
import { difference, episodeBody, serverCpuMs } from './lib/stack.mjs';

const { values: flags } = parseArgs({
  options: {
    rollouts: { type: 'string', default: '2000' },
    concurrency: { type: 'string', default: '64' },
    rounds: { type: 'string', default: '1' },
    out: { type: 'string' },
  },
});
const ROLLOUTS = Number(flags.rollouts);
const CONCURRENCY = Number(flags.concurrency);
if (!Number.isSafeInteger(ROLLOUTS) || ROLLOUTS < 1) throw new Error('--rollouts must be ≥ 1');
if (!Number.isSafeInteger(CONCURRENCY) || CONCURRENCY < 1) {
  throw new Error('--concurrency must be ≥ 1');
}
const ROUNDS = Number(flags.rounds);
if (!Number.isSafeInteger(ROUNDS) || ROUNDS < 1) throw new Error('--rounds must be ≥ 1');
const WARMUP = Math.min(50, ROLLOUTS);
const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const OUT = resolve(flags.out ?? join(repo, 'bench/results/throughput.json'));
const TOKEN = 'bench-throughput-token';

const STACKS = [
  { name: 'checkpoint off, capture off', checkpoint: false, capture: false },
  { name: 'checkpoint on, capture off', checkpoint: true, capture: false },
  { name: 'checkpoint off, capture on', checkpoint: false, capture: true },
  { name: 'checkpoint on, capture on', checkpoint: true, capture: true },
];

function stackYaml(inferencePort, { checkpoint, capture }) {
  const policyFlags = checkpoint
    ? ', checkpoint_policy: true, checkpoint_generation_cuts: true'
    : '';
  return `${checkpoint ? `checkpoint: { enabled: true, control_auth_token: ${TOKEN} }\n` : ''}${
    capture ? 'token_capture: { enabled: true, dir: ./capture }\n' : ''
  }servers:
  inference: { kind: inference, app: fake, port: ${inferencePort}, script: weather }
  policy: { kind: model, app: policy, port: 0, backend_url: "http://127.0.0.1:${inferencePort}/v1"${policyFlags} }
  weather: { kind: resources, app: weather, port: 0 }
  simple_agent: { kind: agent, app: simple, port: 0, model_server: policy, resources_server: weather }
  env: { kind: environment, app: single_agent_turn, port: 0, agent_server: simple_agent, resources_server: weather }
`;
}

function percentile(sorted, p) {
  if (sorted.length === 0) return NaN;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

/** Runs `count` rollouts named `${prefix}-<i>`, `CONCURRENCY` at a time; their latencies in ms. */
async function runRollouts(clients, envUrl, prefix, count) {
  const latencies = [];
  const failures = [];
  let next = 0;
  const worker = async () => {
    while (next < count) {
      const id = `${prefix}-${next++}`;
      const start = performance.now();
      const res = await clients.data.post(`${envUrl}/run`, {
        json: episodeBody(id, 0, 'throughput'),
        retry: { limit: 0 },
        throwHttpErrors: false,
        timeout: { request: 600_000 },
      });
      latencies.push(performance.now() - start);
      const reward = res.statusCode === 200 ? JSON.parse(res.body).result?.reward : undefined;
      if (reward !== 1) failures.push({ id, status: res.statusCode, body: res.body.slice(0, 300) });
    }
  };
  await Promise.all(Array.from({ length: Math.min(CONCURRENCY, count) }, worker));
  return { latencies, failures };
}

/** One stack: launched, warmed up, timed over ROLLOUTS rollouts, stopped. */
async function measure(clients, stack) {
  const runDir = await mkdtemp(join(tmpdir(), 'ckpt-gym-throughput-'));
  const source = join(runDir, 'stack.source.yaml');
  writeFileSync(source, stackYaml(await freePort('127.0.0.1'), stack));
  const handle = await launchStack({ configPath: source, runDir });
  try {
    const envUrl = handle.servers.get('env').url;
    const warm = await runRollouts(clients, envUrl, 'warmup', WARMUP);
    if (warm.failures.length > 0)
      throw new Error(`warm-up failed: ${JSON.stringify(warm.failures[0])}`);
    const cpuBefore = serverCpuMs(handle);
    const start = performance.now();
    const { latencies, failures } = await runRollouts(clients, envUrl, 'r', ROLLOUTS);
    const seconds = (performance.now() - start) / 1000;
    const cpuAfter = serverCpuMs(handle);
    if (failures.length > 0) {
      throw new Error(`${failures.length} rollouts failed, first: ${JSON.stringify(failures[0])}`);
    }
    const spent = difference(cpuBefore.total, cpuAfter.total);
    const sorted = [...latencies].sort((a, b) => a - b);
    return {
      ...stack,
      rollouts_per_s: ROLLOUTS / seconds,
      seconds,
      latency_ms: Object.fromEntries([50, 90, 99].map((p) => [`p${p}`, percentile(sorted, p)])),
      cpu_ms_per_rollout: Object.fromEntries(
        Object.entries(spent).map(([name, ms]) => [name, ms / ROLLOUTS]),
      ),
    };
  } finally {
    await handle.stop({ graceMs: 2000 }).catch(() => undefined);
    await handle.crash({ all: true }).catch(() => undefined);
    await rm(runDir, { recursive: true, force: true });
  }
}

function printTable(rows) {
  const servers = Object.keys(rows[0].cpu_ms_per_rollout);
  const head = ['stack'.padEnd(30), 'rollouts/s', 'p50 ms', 'p90 ms', 'p99 ms'];
  console.log(
    `\n${head.join('')}${servers.map((s) => `cpu ms ${s}`.padStart(20)).join('')}`.replace(
      /(rollouts\/s|p\d\d ms)/g,
      (cell) => cell.padStart(11),
    ),
  );
  for (const row of rows) {
    const cells = [
      row.rollouts_per_s.toFixed(1),
      ...['p50', 'p90', 'p99'].map((p) => row.latency_ms[p].toFixed(1)),
    ].map((cell) => cell.padStart(11));
    const cpu = servers.map((s) => row.cpu_ms_per_rollout[s].toFixed(2).padStart(20));
    console.log(`${row.name.padEnd(30)}${cells.join('')}${cpu.join('')}`);
  }
}

async function main() {
  const loadStart = loadavg();
  const clients = createHttpClients({
    data: { maxSockets: 0, maxTotalSockets: 0 },
    control: { maxSockets: 0, maxTotalSockets: 0 },
  });
  const runs = new Map(STACKS.map((stack) => [stack.name, []]));
  for (let round = 0; round < ROUNDS; round++) {
    for (const stack of round % 2 === 0 ? STACKS : [...STACKS].reverse()) {
      console.error(`${stack.name}: ${ROLLOUTS} rollouts, ${CONCURRENCY} at a time…`);
      runs.get(stack.name).push(await measure(clients, stack));
    }
  }
  const rows = STACKS.map((stack) => {
    const sorted = runs.get(stack.name).sort((a, b) => a.rollouts_per_s - b.rollouts_per_s);
    const rates = sorted.map((r) => r.rollouts_per_s);
    return { ...sorted[Math.floor(sorted.length / 2)], rollouts_per_s_all_rounds: rates };
  });
  const rate = (checkpoint, capture) =>
    rows.find((r) => r.checkpoint === checkpoint && r.capture === capture).rollouts_per_s;
  const ratios = {
    checkpoint_on_over_off: rate(true, false) / rate(false, false),
    checkpoint_on_over_off_with_capture: rate(true, true) / rate(false, true),
    capture_on_over_off: rate(false, true) / rate(false, false),
  };
  printTable(rows);
  console.log('');
  for (const [name, value] of Object.entries(ratios))
    console.log(`${name.padEnd(40)}${value.toFixed(3)}`);
  console.log('target: checkpoint_on_over_off ≥ 0.95 (gate overhead ≤ 5 %)');
  const load = (l) => l.map((x) => x.toFixed(1)).join(' ');
  console.log(`load average (1/5/15 min): ${load(loadStart)} at start, ${load(loadavg())} at end`);
  writeResult(OUT, 'throughput', loadStart, {
    params: { rollouts: ROLLOUTS, concurrency: CONCURRENCY, rounds: ROUNDS, warmup: WARMUP },
    rows,
    ratios,
    targets: { checkpoint_on_over_off: 0.95 },
  });
  console.log(`wrote ${OUT}`);
}

await main();
