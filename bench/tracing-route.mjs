/* global Buffer, console, process, setTimeout */
// What tracing costs a gym server per request, where the cost builds up: two server processes
// at once, each a gym app with one JSON route (core's request lifecycle: request id, metrics,
// the route's span, body parsing), one traced and one not, both driven the same way over
// keep-alive sockets; each server's CPU (from /proc) per request over a timed window after a
// warm-up. Both are relaunched each block with the order swapped. Unlike `tracing-cost` (tracing
// toggled in one process) each server keeps one mode for its whole life, so what tracing leaves
// in a process's heap (and its garbage collection) is counted; unlike `tracing-stack` it takes a
// minute or two and resolves a point or two.
//
//   npm run build && npm run bench -- tracing-route [--blocks 4] [--warmup 10] [--seconds 8]
//     [--concurrency 16] [--traceparent unsampled|sampled|none] [--rollout-sample-ratio R]
//
// --traceparent: what each request carries (a caller whose trace is not sampled, as at every
// server but the first with rollouts unsampled; a sampled one, as with every rollout recorded;
// none, a trace's first server). --rollout-sample-ratio: the traced server's
// `telemetry.traces.rollout_sample_ratio` (default: the stack's default). The traced server
// exports to a sink in this process. Prints the figures and writes
// bench/results/tracing-route.json (or --out).
import { fork } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import http from 'node:http';
import { loadavg } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import { benchFlags, integerFlag, nextMessage, refuse } from './lib/flags.mjs';
import { otlpSink } from './lib/otlp-sink.mjs';
import { sampleCpu } from './lib/processes.mjs';
import { writeResult } from './lib/results.mjs';

const flags = benchFlags(import.meta.url, {
  options: {
    blocks: { type: 'string', default: '4' },
    warmup: { type: 'string', default: '10' },
    seconds: { type: 'string', default: '8' },
    concurrency: { type: 'string', default: '16' },
    traceparent: { type: 'string', default: 'unsampled' },
    'rollout-sample-ratio': { type: 'string' },
    out: { type: 'string' },
  },
});
const BLOCKS = integerFlag(flags, 'blocks', 2);
const WARMUP = integerFlag(flags, 'warmup', 0);
const SECONDS = integerFlag(flags, 'seconds', 1);
const CONCURRENCY = integerFlag(flags, 'concurrency', 1);
const CALLER = flags.traceparent;
if (!['unsampled', 'sampled', 'none'].includes(CALLER))
  refuse('--traceparent must be unsampled, sampled or none');
const RATIO = flags['rollout-sample-ratio'];
if (RATIO !== undefined && !(Number(RATIO) >= 0 && Number(RATIO) <= 1))
  refuse('--rollout-sample-ratio must be a number from 0 to 1');
const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const OUT = resolve(flags.out ?? join(repo, 'bench/results/tracing-route.json'));
const SERVER = join(repo, 'bench/lib/route-server.mjs');

const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

/** A process's CPU so far (user + system), in ms. */
const cpuMs = (pid) => sampleCpu(pid).cpu_ms;

/** One route server, traced (to `sink`) or not; resolves once it listens. */
async function launch(traced, sink) {
  const env = traced
    ? { OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: sink.url, ROUTE_SERVER_SAMPLE_RATIO: RATIO ?? '' }
    : { OTEL_SDK_DISABLED: 'true' };
  const child = fork(SERVER, { env: { ...process.env, ...env }, stdio: 'inherit' });
  const { port } = await nextMessage(child);
  return { traced, child, port, served: 0 };
}

function traceparentHeader() {
  if (CALLER === 'none') return {};
  const flags = CALLER === 'sampled' ? '01' : '00';
  const id = (bytes) => randomBytes(bytes).toString('hex');
  return { traceparent: `00-${id(16)}-${id(8)}-${flags}` };
}

/** Posts to `server`'s route, CONCURRENCY at a time, until `stopped()`. */
async function drive(server, stopped) {
  const agent = new http.Agent({ keepAlive: true, maxSockets: CONCURRENCY });
  const body = JSON.stringify({ rollout: 'r-1', note: 'x'.repeat(200) });
  const post = () =>
    new Promise((done, fail) => {
      const headers = {
        'content-type': 'application/json',
        'content-length': Buffer.byteLength(body),
        ...traceparentHeader(),
      };
      const req = http.request(
        { host: '127.0.0.1', port: server.port, path: '/echo', method: 'POST', agent, headers },
        (res) => {
          res.resume();
          res.on('end', () => {
            if (res.statusCode !== 200) fail(new Error(`status ${res.statusCode}`));
            server.served += 1;
            done();
          });
        },
      );
      req.on('error', fail);
      req.end(body);
    });
  const loop = async () => {
    while (!stopped()) await post();
  };
  await Promise.all(Array.from({ length: CONCURRENCY }, loop));
  agent.destroy();
}

/** One block: both servers launched (traced first when `tracedFirst`), driven, measured, stopped. */
async function block(sink, tracedFirst) {
  const servers = [];
  for (const traced of [tracedFirst, !tracedFirst]) servers.push(await launch(traced, sink));
  let stopped = false;
  const driving = servers.map((server) => drive(server, () => stopped));
  try {
    await sleep(WARMUP * 1000);
    const before = servers.map((s) => ({ cpu: cpuMs(s.child.pid), served: s.served }));
    await sleep(SECONDS * 1000);
    const row = {};
    servers.forEach((s, i) => {
      const requests = s.served - before[i].served;
      row[s.traced ? 'on' : 'off'] = {
        cpu_us_per_request: ((cpuMs(s.child.pid) - before[i].cpu) * 1000) / requests,
        requests_per_s: requests / SECONDS,
      };
    });
    return row;
  } finally {
    stopped = true;
    await Promise.all(driving);
    for (const s of servers) s.child.kill('SIGTERM');
  }
}

async function main() {
  const loadStart = loadavg();
  const sink = await otlpSink();
  const blocks = [];
  try {
    for (let i = 0; i < BLOCKS; i += 1) {
      const row = await block(sink, i % 2 === 0);
      row.ratio = row.on.cpu_us_per_request / row.off.cpu_us_per_request;
      blocks.push(row);
      const cell = (m) =>
        `${m} ${row[m].cpu_us_per_request.toFixed(1)} µs (${row[m].requests_per_s.toFixed(0)}/s)`;
      console.error(
        `block ${i + 1}: ${cell('on')}   ${cell('off')}   on/off ${row.ratio.toFixed(3)}`,
      );
    }
  } finally {
    await sink.close();
  }
  if (CALLER !== 'unsampled' && RATIO === undefined && !(sink.spans() > 0))
    throw new Error('tracing on, but the sink received no span');
  const ratios = blocks.map((b) => b.ratio);
  const mean = ratios.reduce((sum, r) => sum + r, 0) / ratios.length;
  const spread = ratios.reduce((sum, r) => sum + (r - mean) ** 2, 0);
  const standardError = Math.sqrt(spread / (ratios.length - 1) / ratios.length);
  console.log(
    `\ncaller's traceparent: ${CALLER}; rollouts sampled: ${RATIO ?? 'the default'}; spans received: ${sink.spans()}`,
  );
  console.log(
    `server CPU per request, tracing on over off, mean of ${BLOCKS} blocks ± standard error: ${mean.toFixed(3)} ± ${standardError.toFixed(3)}`,
  );
  writeResult(OUT, 'tracing-route', loadStart, {
    params: {
      blocks: BLOCKS,
      warmup: WARMUP,
      seconds: SECONDS,
      concurrency: CONCURRENCY,
      traceparent: CALLER,
      rollout_sample_ratio: RATIO ?? 'default',
    },
    cpu_ratio: { mean, standard_error: standardError },
    spans_received: sink.spans(),
    blocks,
  });
  console.log(`wrote ${OUT}`);
}

await main();
