/* global console, performance, process */
// Throughput: the whole native stack (fake backend with no latency, policy model, weather
// resources, Simple Agent, single_agent_turn environment, each its own process started by the
// CLI's launcher) running N weather rollouts through the environment's /run, C at a time, in four
// stacks: checkpointing off and on, token capture off and on. Per stack: rollouts per second,
// end-to-end latency percentiles, each server's CPU per rollout, and per-hop latency percentiles
// (environment → agent → policy, agent → resources: each route as its server timed it, from the
// access-timing lines the servers write at CKPT_GYM_LOG_LEVEL=debug, which the bench turns on).
// The figure that matters is the ratio of "on" to "off" in one run: the gate's overhead.
//
//   npm run build && npm run bench -- throughput [--rollouts 2000] [--concurrency 64] [--profile]
//     [--no-capture]
//
// --rounds R runs the four stacks R times, in reversed order every other round (the machine's load
// drifts), and reports each stack's median round by rollouts per second.
// The access-timing lines cost the servers a little (winston's JSON line per request); --no-hops
// leaves them off (no hop table) to see how much.
// --telemetry compares tracing off and on instead (checkpointing and capture on in both): with it
// on every server exports its spans over OTLP/HTTP to a local sink (tracing's overhead, target ≤ 3 %),
// which counts the spans without parsing them: it shares the servers' cores, a real collector does not.
// --no-capture runs only the two stacks with capture off (the gate's overhead alone, half the time).
// --profile runs every server under V8's CPU profiler over the timed rollouts (.cpuprofile files as
// --cpu-prof writes, under bench/results/throughput-profiles/) and prints each one's top functions
// by self time; profiling slows the servers, so its rollouts/s are not the figure to quote.
// Prints a table and writes bench/results/throughput.json (or --out).
import { execFileSync } from 'node:child_process';
import { mkdirSync, rmSync, writeFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { loadavg, tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import { freePort, launchStack } from '@ckpt-gym/coordinator-cli';
import { createHttpClients } from '@ckpt-gym/core/client';

import {
  ACCESS_LOG_ENV,
  hopByKey,
  hopLatencies,
  outsideCalls,
  stackAccessLines,
} from './lib/hops.mjs';
import { benchFlags, integerFlag } from './lib/flags.mjs';
import { otlpSink } from './lib/otlp-sink.mjs';
import { percentiles } from './lib/percentile.mjs';
import { cpuProfileEnv, serverProfiles, toggleProfiles } from './lib/profile.mjs';
import { writeResult } from './lib/results.mjs';
import { difference, episodeBody, nativeStackYaml, serverCpuMs } from './lib/stack.mjs';

const flags = benchFlags(import.meta.url, {
  options: {
    rollouts: { type: 'string', default: '2000' },
    concurrency: { type: 'string', default: '64' },
    rounds: { type: 'string', default: '1' },
    out: { type: 'string' },
    profile: { type: 'boolean', default: false },
    'no-hops': { type: 'boolean', default: false },
    telemetry: { type: 'boolean', default: false },
    'no-capture': { type: 'boolean', default: false },
  },
});
const ROLLOUTS = integerFlag(flags, 'rollouts', 1);
const CONCURRENCY = integerFlag(flags, 'concurrency', 1);
const ROUNDS = integerFlag(flags, 'rounds', 1);
const WARMUP = Math.min(50, ROLLOUTS);
const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const OUT = resolve(flags.out ?? join(repo, 'bench/results/throughput.json'));
const PROFILE_DIR = join(dirname(OUT), 'throughput-profiles');

const STACKS = flags.telemetry
  ? [
      { name: 'telemetry off', checkpoint: true, capture: true, telemetry: false },
      { name: 'telemetry on', checkpoint: true, capture: true, telemetry: true },
    ]
  : [
      { name: 'checkpoint off, capture off', checkpoint: false, capture: false },
      { name: 'checkpoint on, capture off', checkpoint: true, capture: false },
      { name: 'checkpoint off, capture on', checkpoint: false, capture: true },
      { name: 'checkpoint on, capture on', checkpoint: true, capture: true },
    ].filter((stack) => !(flags['no-capture'] && stack.capture));
/** With --telemetry: where the servers of a stack with telemetry on send their spans. */
const sink = flags.telemetry ? await otlpSink() : undefined;

/**
 * Runs `count` rollouts named `${prefix}-<i>`, `CONCURRENCY` at a time; their latencies in ms, by
 * rollout id (the capture key of its attempt 0).
 */
async function runRollouts(clients, envUrl, prefix, count) {
  const latencies = new Map();
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
      latencies.set(id, performance.now() - start);
      const reward = res.statusCode === 200 ? JSON.parse(res.body).result?.reward : undefined;
      if (reward !== 1) failures.push({ id, status: res.statusCode, body: res.body.slice(0, 300) });
    }
  };
  await Promise.all(Array.from({ length: Math.min(CONCURRENCY, count) }, worker));
  return { latencies, failures };
}

/**
 * The direct calls of the environment's and the agent's episode work in this stack (server, method,
 * route as the access lines name them), for the time each spends outside them.
 */
const ENVIRONMENT_CALLS = [
  'simple_agent POST /v1/agent_sessions',
  'simple_agent POST /v1/responses',
  'simple_agent POST /v1/agent_sessions/close',
  'weather POST /seed_session',
  'weather POST /verify',
  'weather POST /close_session',
];
const AGENT_RUN = 'simple_agent POST /v1/responses';
const AGENT_CALLS = ['policy POST /v1/responses', 'weather POST /get_weather'];

/** Per-hop percentiles, and the environment's and agent's time outside their calls. */
function hopFigures(lines, latencies) {
  if (lines.length === 0) return {};
  return {
    hops: hopLatencies(lines),
    outside_calls: {
      'client → env /run, outside its calls': outsideCalls(lines, latencies, ENVIRONMENT_CALLS),
      'simple_agent /v1/responses, outside its calls': outsideCalls(
        lines,
        hopByKey(lines, AGENT_RUN),
        AGENT_CALLS,
      ),
    },
  };
}

/** Where a stack's servers write their CPU profiles with --profile (emptied first). */
function profileDir(stack, round) {
  const dir = join(PROFILE_DIR, `${stack.name.replace(/[^a-z]+/g, '-')}-round-${round}`);
  rmSync(dir, { recursive: true, force: true });
  mkdirSync(dir, { recursive: true });
  return dir;
}

/** One stack: launched, warmed up, timed over ROLLOUTS rollouts, stopped. */
async function measure(clients, stack, round) {
  const runDir = await mkdtemp(join(tmpdir(), 'ckpt-gym-throughput-'));
  const source = join(runDir, 'stack.source.yaml');
  writeFileSync(source, nativeStackYaml(await freePort('127.0.0.1'), stack));
  const profiles = flags.profile ? profileDir(stack, round) : undefined;
  const env = {
    ...process.env,
    ...(flags['no-hops'] ? {} : ACCESS_LOG_ENV),
    ...(profiles ? cpuProfileEnv(profiles) : {}),
    // Off means off, whatever OTEL_* the shell has.
    ...(stack.telemetry === false ? { OTEL_SDK_DISABLED: 'true' } : {}),
    ...(stack.telemetry ? { OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: sink.url } : {}),
  };
  const spansBefore = sink?.spans() ?? 0;
  const handle = await launchStack({ configPath: source, runDir, env });
  try {
    const envUrl = handle.servers.get('env').url;
    const warm = await runRollouts(clients, envUrl, 'warmup', WARMUP);
    if (warm.failures.length > 0)
      throw new Error(`warm-up failed: ${JSON.stringify(warm.failures[0])}`);
    if (profiles) toggleProfiles(handle);
    const cpuBefore = serverCpuMs(handle);
    const [wallStart, start] = [Date.now(), performance.now()];
    const { latencies, failures } = await runRollouts(clients, envUrl, 'r', ROLLOUTS);
    const seconds = (performance.now() - start) / 1000;
    const cpuAfter = serverCpuMs(handle);
    if (profiles) toggleProfiles(handle);
    if (failures.length > 0) {
      throw new Error(`${failures.length} rollouts failed, first: ${JSON.stringify(failures[0])}`);
    }
    // Stopped first: each server has flushed its log and written its profile when it exits.
    await handle.stop({ graceMs: 10_000 });
    const spent = difference(cpuBefore.total, cpuAfter.total);
    return {
      ...stack,
      ...(sink ? { spans_per_rollout: (sink.spans() - spansBefore) / (ROLLOUTS + WARMUP) } : {}),
      rollouts_per_s: ROLLOUTS / seconds,
      seconds,
      latency_ms: percentiles([...latencies.values()]),
      cpu_ms_per_rollout: Object.fromEntries(
        Object.entries(spent).map(([name, ms]) => [name, ms / ROLLOUTS]),
      ),
      // Up to now: a rollout's clean-up calls may end after its reply, and nothing else ran since.
      ...hopFigures(stackAccessLines(handle, wallStart, Date.now()), latencies),
      ...(profiles ? { profiles: serverProfiles(handle, profiles, repo) } : {}),
    };
  } finally {
    await handle.stop({ graceMs: 2000 }).catch(() => undefined);
    await handle.crash({ all: true }).catch(() => undefined);
    await rm(runDir, { recursive: true, force: true });
    // The stack's capture files, written and deleted, are flushed now, not by the kernel during
    // the next stack's timed rollouts (which made whichever stack ran second the slower one).
    execFileSync('sync');
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

/** Per hop, each stack's p50/p90/p99 in ms as the callee timed it. */
/** A p50/p90/p99 cell. */
const triple = (ms) =>
  (ms ? `${ms.p50.toFixed(2)}/${ms.p90.toFixed(2)}/${ms.p99.toFixed(2)}` : '-').padStart(30);

/** Per hop, each stack's p50/p90/p99 in ms as the callee timed it; then the time outside calls. */
function printHops(rows) {
  if (flags['no-hops']) return;
  const hops = [...new Set(rows.flatMap((row) => Object.keys(row.hops)))];
  const outside = Object.keys(rows[0].outside_calls);
  const width = Math.max(...[...hops, ...outside].map((name) => name.length)) + 2;
  console.log(
    `\nper hop, ms p50/p90/p99 (the callee's route time; client → env is seen by the client above)`,
  );
  console.log(`${'hop'.padEnd(width)}${rows.map((row) => row.name.padStart(30)).join('')}`);
  for (const hop of hops) {
    console.log(`${hop.padEnd(width)}${rows.map((row) => triple(row.hops[hop]?.ms)).join('')}`);
  }
  console.log('outside the calls it makes, per episode (own work + transit of its calls):');
  for (const name of outside) {
    const cells = rows.map((row) => triple(row.outside_calls[name]?.ms));
    console.log(`${name.padEnd(width)}${cells.join('')}`);
  }
}

/** Per stack and server, the top functions by self time (--profile). */
function printProfiles(rows) {
  for (const row of rows.filter((r) => r.profiles)) {
    console.log(`\nCPU profile, ${row.name}: top self time per server`);
    for (const [server, profile] of Object.entries(row.profiles)) {
      const perRollout = row.cpu_ms_per_rollout[server];
      const cpu = perRollout === undefined ? '' : `, CPU ${(perRollout * ROLLOUTS).toFixed(0)} ms`;
      // Busy is wall time the sampler found the thread not idle, off-CPU waits included (on a
      // loaded machine a socket write that wakes its reader can lose the CPU: `writev` grows).
      console.log(`  ${server} (busy ${profile.busy_ms.toFixed(0)} ms${cpu}, ${profile.file})`);
      for (const { fn, self_ms, share } of profile.functions) {
        console.log(
          `    ${(share * 100).toFixed(1).padStart(5)} %  ${self_ms.toFixed(0).padStart(6)} ms  ${fn}`,
        );
      }
    }
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
      runs.get(stack.name).push(await measure(clients, stack, round));
    }
  }
  const rows = STACKS.map((stack) => {
    const sorted = runs.get(stack.name).sort((a, b) => a.rollouts_per_s - b.rollouts_per_s);
    const rates = sorted.map((r) => r.rollouts_per_s);
    return { ...sorted[Math.floor(sorted.length / 2)], rollouts_per_s_all_rounds: rates };
  });
  const { ratios, targets } = flags.telemetry ? telemetryRatios(rows) : stackRatios(rows);
  printTable(rows);
  printHops(rows);
  printProfiles(rows);
  console.log('');
  for (const [name, value] of Object.entries(ratios))
    console.log(`${name.padEnd(40)}${value.toFixed(3)}`);
  for (const row of rows.filter((r) => r.spans_per_rollout !== undefined))
    console.log(
      `${row.name}: ${row.spans_per_rollout.toFixed(1)} spans per rollout sent to the sink`,
    );
  for (const [name, value] of Object.entries(targets))
    console.log(`target: ${name} ≥ ${value} (overhead ≤ ${Math.round((1 - value) * 100)} %)`);
  const load = (l) => l.map((x) => x.toFixed(1)).join(' ');
  console.log(`load average (1/5/15 min): ${load(loadStart)} at start, ${load(loadavg())} at end`);
  writeResult(OUT, 'throughput', loadStart, {
    params: {
      rollouts: ROLLOUTS,
      concurrency: CONCURRENCY,
      rounds: ROUNDS,
      warmup: WARMUP,
      profile: flags.profile,
      hops: !flags['no-hops'],
      telemetry: flags.telemetry,
      capture_stacks: !flags['no-capture'],
    },
    rows,
    ratios,
    targets,
  });
  console.log(`wrote ${OUT}`);
  await sink?.close();
}

/** The gate's and the capture's overheads, from the four stacks. */
function stackRatios(rows) {
  const rate = (checkpoint, capture) =>
    rows.find((r) => r.checkpoint === checkpoint && r.capture === capture).rollouts_per_s;
  const ratios = {
    checkpoint_on_over_off: rate(true, false) / rate(false, false),
    ...(flags['no-capture']
      ? {}
      : {
          checkpoint_on_over_off_with_capture: rate(true, true) / rate(false, true),
          capture_on_over_off: rate(false, true) / rate(false, false),
        }),
  };
  return { ratios, targets: { checkpoint_on_over_off: 0.95 } };
}

/** Tracing's overhead (--telemetry); a stack with telemetry on that sent no span fails the run. */
function telemetryRatios(rows) {
  const [off, on] = [false, true].map((t) => rows.find((r) => r.telemetry === t));
  if (!(on.spans_per_rollout > 0)) throw new Error('telemetry on, but the sink received no span');
  return {
    ratios: { telemetry_on_over_off: on.rollouts_per_s / off.rollouts_per_s },
    targets: { telemetry_on_over_off: 0.97 },
  };
}

await main();
