/* global console, performance, process, setTimeout */
// Tracing's cost in the whole native stack, resolved on a shared machine. `throughput --telemetry`
// runs its two stacks one after the other, and between two identical stacks run so its ratio
// moves by ±7 % here (the load of the minutes each ran under); this runs two identical stacks at
// the same time (checkpointing and capture on), one with tracing on and one off, each driven by its
// own rollouts, so whatever loads the machine loads both alike. After each block both are stopped
// and relaunched with the roles swapped (A on and B off, then A off and B on), so neither stack's
// ports, files or start-up decide it. Per block and stack: each server's CPU (from /proc) per
// rollout completed in the block's window. The figure is the mean of the blocks' on/off ratios of
// the servers' CPU (the fake backend's apart, as `throughput` counts it), with its standard error.
// With tracing on the servers export to a local sink, as in `throughput --telemetry`.
//
//   npm run build && npm run bench -- tracing-stack [--blocks 8] [--seconds 30] [--warmup 60]
//     [--concurrency 32] [--aa] [--rollout-sample-ratio R|all]
//
// Each block starts fresh processes: the warm-up is long because a server's code runs colder than
// it will for hours afterwards for about a minute (with 10 s of warm-up the servers' CPU per rollout
// was 12-15 ms and tracing's share twice what it is after 60 s, where it is 10 ms).
// --aa runs tracing off in both stacks: the method's own noise (the ratio is B over A).
// --rollout-sample-ratio sets the traced stack's `telemetry.traces.rollout_sample_ratio` (`all`:
// OTEL_TRACES_SAMPLER=parentbased_always_on, every span); without it, the stack's default.
// Prints the figures and writes bench/results/tracing-stack.json (or --out).
import { writeFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { loadavg, tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import { freePort, launchStack } from '@ckpt-gym/coordinator-cli';
import { createHttpClients } from '@ckpt-gym/core/client';

import { benchFlags, integerFlag, refuse } from './lib/flags.mjs';
import { otlpSink } from './lib/otlp-sink.mjs';
import { writeResult } from './lib/results.mjs';
import { difference, episodeBody, nativeStackYaml, serverCpuMs } from './lib/stack.mjs';

const flags = benchFlags(import.meta.url, {
  options: {
    blocks: { type: 'string', default: '8' },
    seconds: { type: 'string', default: '30' },
    warmup: { type: 'string', default: '60' },
    concurrency: { type: 'string', default: '32' },
    aa: { type: 'boolean', default: false },
    'rollout-sample-ratio': { type: 'string' },
    out: { type: 'string' },
  },
});
const BLOCKS = integerFlag(flags, 'blocks', 2);
const SECONDS = integerFlag(flags, 'seconds', 1);
const WARMUP = integerFlag(flags, 'warmup', 0);
const CONCURRENCY = integerFlag(flags, 'concurrency', 1);
const SAMPLED = flags['rollout-sample-ratio'];
if (SAMPLED !== undefined && SAMPLED !== 'all' && !(Number(SAMPLED) >= 0 && Number(SAMPLED) <= 1))
  refuse('--rollout-sample-ratio must be a number from 0 to 1, or all');
const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const OUT = resolve(flags.out ?? join(repo, 'bench/results/tracing-stack.json'));

const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

/** One stack, tracing on or off, launched from a fresh directory. */
async function launch(tracing, sink) {
  const runDir = await mkdtemp(join(tmpdir(), 'ckpt-gym-tracing-stack-'));
  const source = join(runDir, 'stack.source.yaml');
  const yaml = nativeStackYaml(await freePort('127.0.0.1'), { checkpoint: true, capture: true });
  const ratio = SAMPLED === undefined || SAMPLED === 'all' ? '' : SAMPLED;
  writeFileSync(
    source,
    ratio ? `telemetry: { traces: { rollout_sample_ratio: ${ratio} } }\n${yaml}` : yaml,
  );
  const env = {
    ...process.env,
    ...(tracing ? { OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: sink.url } : { OTEL_SDK_DISABLED: 'true' }),
    ...(SAMPLED === 'all' ? { OTEL_TRACES_SAMPLER: 'parentbased_always_on' } : {}),
  };
  const handle = await launchStack({ configPath: source, runDir, env });
  return { tracing, runDir, handle, completed: 0 };
}

async function stop(stack) {
  await stack.handle.stop({ graceMs: 5000 }).catch(() => undefined);
  await stack.handle.crash({ all: true }).catch(() => undefined);
  await rm(stack.runDir, { recursive: true, force: true });
}

/** Runs rollouts on `stack`, CONCURRENCY at a time, until `stopped()`; counts those completed. */
async function drive(clients, stack, stopped) {
  const envUrl = stack.handle.servers.get('env').url;
  let next = 0;
  const worker = async () => {
    while (!stopped()) {
      const id = `r-${next++}`;
      const res = await clients.data.post(`${envUrl}/run`, {
        json: episodeBody(id, 0, 'tracing-stack'),
        retry: { limit: 0 },
        throwHttpErrors: false,
        timeout: { request: 600_000 },
      });
      if (res.statusCode !== 200) throw new Error(`${id}: ${res.statusCode} ${res.body}`);
      stack.completed += 1;
    }
  };
  await Promise.all(Array.from({ length: CONCURRENCY }, worker));
}

/** One block: both stacks launched, driven together, measured over SECONDS, stopped. */
async function block(clients, sink, aTraces) {
  // --aa: neither stack traces, whichever block it is.
  const tracing = flags.aa ? [false, false] : [aTraces, !aTraces];
  const stacks = await Promise.all(tracing.map((on) => launch(on, sink)));
  let stopped = false;
  const driving = stacks.map((stack) => drive(clients, stack, () => stopped));
  let rows = [];
  try {
    await sleep(WARMUP * 1000);
    const before = stacks.map((stack) => ({
      cpu: serverCpuMs(stack.handle).total,
      done: stack.completed,
    }));
    const start = performance.now();
    await sleep(SECONDS * 1000);
    const seconds = (performance.now() - start) / 1000;
    rows = stacks.map((stack, i) => {
      const rollouts = stack.completed - before[i].done;
      const spent = difference(before[i].cpu, serverCpuMs(stack.handle).total);
      const cpu = Object.fromEntries(
        Object.entries(spent).map(([name, ms]) => [name, ms / rollouts]),
      );
      return {
        stack: i === 0 ? 'A' : 'B',
        tracing: stack.tracing,
        rollouts,
        rollouts_per_s: rollouts / seconds,
        cpu_ms_per_rollout: cpu,
      };
    });
    return rows;
  } finally {
    stopped = true;
    await Promise.all(driving);
    // Every rollout the stack ran, warm-up included: what its spans are counted over.
    rows.forEach((row, i) => (row.rollouts_completed = stacks[i].completed));
    await Promise.all(stacks.map(stop));
  }
}

/** Mean and standard error of `values`. */
function meanAndError(values) {
  const mean = values.reduce((sum, v) => sum + v, 0) / values.length;
  const spread = values.reduce((sum, v) => sum + (v - mean) ** 2, 0);
  return { mean, standard_error: Math.sqrt(spread / (values.length - 1) / values.length) };
}

/** Per server and in all: the mean of the blocks' on/off (A/A: B/A) CPU ratios. */
function ratios(blocks) {
  const pairs = blocks.map((rows) =>
    flags.aa ? rows : [rows.find((r) => !r.tracing), rows.find((r) => r.tracing)],
  );
  const servers = Object.keys(pairs[0][0].cpu_ms_per_rollout);
  return Object.fromEntries(
    servers.map((server) => [
      server,
      meanAndError(
        pairs.map(([off, on]) => on.cpu_ms_per_rollout[server] / off.cpu_ms_per_rollout[server]),
      ),
    ]),
  );
}

async function main() {
  const loadStart = loadavg();
  const sink = await otlpSink();
  const clients = createHttpClients({
    data: { maxSockets: 0, maxTotalSockets: 0 },
    control: { maxSockets: 0, maxTotalSockets: 0 },
  });
  const blocks = [];
  try {
    for (let i = 0; i < BLOCKS; i += 1) {
      const rows = await block(clients, sink, i % 2 === 0);
      blocks.push(rows);
      const cells = rows.map(
        (r) =>
          `${r.stack} ${r.tracing ? 'on ' : 'off'} ${r.rollouts_per_s.toFixed(1)} rollouts/s, ${r.cpu_ms_per_rollout.all.toFixed(2)} ms CPU a rollout`,
      );
      console.error(`block ${i + 1}: ${cells.join('   ')}`);
    }
  } finally {
    clients.close();
    await sink.close();
  }
  const spansExpected = !flags.aa && !(SAMPLED !== undefined && Number(SAMPLED) === 0);
  if (spansExpected && !(sink.spans() > 0))
    throw new Error('tracing on, but the sink received no span');
  const figures = ratios(blocks);
  const what = flags.aa ? 'A/A, tracing off in both: B over A' : 'tracing on over off';
  const traced = blocks.flat().filter((row) => row.tracing);
  const spansPerRollout =
    sink.spans() / traced.reduce((sum, row) => sum + row.rollouts_completed, 0) || 0;
  console.log(
    `\nrollouts sampled: ${SAMPLED ?? 'the default'}; spans received a rollout: ${spansPerRollout.toFixed(2)}`,
  );
  console.log(`servers' CPU per rollout, ${what}, mean of ${BLOCKS} blocks ± standard error:`);
  for (const [server, { mean, standard_error }] of Object.entries(figures))
    console.log(`${server.padEnd(14)}${mean.toFixed(3)} ± ${standard_error.toFixed(3)}`);
  console.log(
    `load average (1/5/15 min) at end: ${loadavg()
      .map((l) => l.toFixed(1))
      .join(' ')}`,
  );
  writeResult(OUT, 'tracing-stack', loadStart, {
    params: {
      blocks: BLOCKS,
      seconds: SECONDS,
      warmup: WARMUP,
      concurrency: CONCURRENCY,
      aa: flags.aa,
      rollout_sample_ratio: SAMPLED ?? 'default',
    },
    spans_per_rollout: spansPerRollout,
    cpu_ratio: figures,
    blocks,
  });
  console.log(`wrote ${OUT}`);
}

await main();
