/* global Buffer, console, process, URL */
// What tracing costs one server per request, without the stack's noise: the weather resources
// server in this process (checkpointing off), driven with a rollout's four requests (seed, tool
// call, verify, close) 16 at a time over keep-alive sockets, each carrying a caller's
// `traceparent` as the stack's calls do. Blocks of rollouts alternate tracing off and on in the
// same process (on: the real OTLP/HTTP exporter, batched, to a sink in a child process; stopped,
// its last spans exported, before the next block), so the machine's load drifts alike over both;
// the figure is the mean of the paired differences (each on block minus the off block before it)
// with its standard error. The CPU is this process's: server and client, the client's share the
// same in both. On this shared 2-core machine the stack bench's CPU per rollout moves by ±1 ms
// between two identical stacks; this resolves tens of µs.
// Tracing is toggled inside one process, so what a traced process's heap carries for its whole
// life is not seen here (a request's context cost 15 % that way): `tracing-route` measures it.
//
//   npm run build && npm run bench -- tracing-cost [--rollouts 200] [--blocks 14]
//
// --rollouts is per block, --blocks the number of pairs. Prints the figures and writes
// bench/results/tracing-cost.json (or --out).
import { fork } from 'node:child_process';
import { once } from 'node:events';
import http from 'node:http';
import { loadavg } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import { startTracing, stopTracing } from '@ckpt-gym/core/client';
import { listen } from '@ckpt-gym/core/server';
import { createResourcesServer, weatherServer } from '@ckpt-gym/resources-server';

import { otlpSink } from './lib/otlp-sink.mjs';
import { benchFlags, integerFlag, nextMessage } from './lib/flags.mjs';
import { writeResult } from './lib/results.mjs';

const SINK_CHILD = '--sink-child';

/** The child: a sink that sends its URL, then its span count whenever asked. */
async function runSinkChild() {
  const sink = await otlpSink();
  process.send(sink.url);
  process.on('message', () => process.send(sink.spans()));
  process.once('disconnect', () => sink.close());
}

async function main() {
  const flags = benchFlags(import.meta.url, {
    options: {
      rollouts: { type: 'string', default: '200' },
      blocks: { type: 'string', default: '14' },
      out: { type: 'string' },
    },
  });
  const rollouts = integerFlag(flags, 'rollouts', 1);
  const blocks = integerFlag(flags, 'blocks', 2);
  const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
  const out = resolve(flags.out ?? join(repo, 'bench/results/tracing-cost.json'));
  const loadStart = loadavg();
  const child = fork(fileURLToPath(import.meta.url), [SINK_CHILD]);
  const sinkUrl = await nextMessage(child);
  const server = await listen(weatherApp(), 0);
  const client = rolloutClient(server.url);
  try {
    const figures = await measure(client, { rollouts, blocks, sinkUrl });
    const counted = nextMessage(child);
    child.send('count');
    const spans = await counted;
    if (!(spans > 0)) throw new Error('tracing on, but the sink received no span');
    report(figures);
    writeResult(out, 'tracing-cost', loadStart, {
      params: { rollouts_per_block: rollouts, blocks, concurrency: CONCURRENCY },
      ...figures,
    });
    console.log(`wrote ${out}`);
  } finally {
    client.close();
    await server.close();
    child.disconnect();
  }
}

const CONCURRENCY = 16;
const REQUESTS_PER_ROLLOUT = 4;
/** A caller's trace context, as every call after a rollout's first carries one. */
const TRACEPARENT = `00-${'ab'.repeat(16)}-${'cd'.repeat(8)}-01`;

function weatherApp() {
  const silent = { error() {}, warn() {}, info() {}, debug() {}, child: () => silent };
  const options = { name: 'weather', checkpoint: undefined, logger: silent };
  return createResourcesServer(weatherServer(), options).app;
}

/** Runs rollouts against the weather server at `base` (see the file comment). */
function rolloutClient(base) {
  const sockets = new http.Agent({ keepAlive: true, maxSockets: CONCURRENCY });
  const post = async (path, body, cookie) => {
    const data = JSON.stringify(body);
    const headers = {
      'content-type': 'application/json',
      'content-length': Buffer.byteLength(data),
      traceparent: TRACEPARENT,
      ...(cookie ? { cookie } : {}),
    };
    const req = http.request(new URL(path, base), { method: 'POST', agent: sockets, headers });
    req.end(data);
    const [res] = await once(req, 'response');
    const chunks = [];
    for await (const chunk of res) chunks.push(chunk);
    if (res.statusCode !== 200)
      throw new Error(`${path}: ${res.statusCode} ${Buffer.concat(chunks)}`);
    return res.headers['set-cookie']?.[0]?.split(';')[0] ?? cookie;
  };
  const rollout = async (id) => {
    const session = { resources_session_id: `s-${id}`, episode_id: { rollout_id: id, attempt: 0 } };
    const task = { task_id: { taskset: 'tracing-cost', task_id: 'weather' }, task_data: {} };
    const cookie = await post(`/ng-rollout/${id}/seed_session`, { ...session, ...task });
    await post('/get_weather', { city: 'San Francisco' }, cookie);
    const output = [{ type: 'message', content: [{ type: 'output_text', text: 'sunny' }] }];
    await post(
      `/ng-rollout/${id}/verify`,
      { response: { output }, verification_input: {} },
      cookie,
    );
    await post(`/ng-rollout/${id}/close_session`, session, cookie);
  };
  let started = 0;
  return {
    async run(count) {
      let left = count;
      const worker = async () => {
        while (left-- > 0) await rollout(`r-${started++}`);
      };
      await Promise.all(Array.from({ length: CONCURRENCY }, worker));
    },
    close: () => sockets.destroy(),
  };
}

/** CPU µs per request of one block, tracing on or off (a warm-up of a quarter block first). */
async function block(client, rollouts, tracingPlan) {
  if (tracingPlan) startTracing(tracingPlan, { instance: 'weather' });
  try {
    await client.run(Math.ceil(rollouts / 4));
    const start = process.cpuUsage();
    await client.run(rollouts);
    const used = process.cpuUsage(start);
    return (used.user + used.system) / (rollouts * REQUESTS_PER_ROLLOUT);
  } finally {
    if (tracingPlan) await stopTracing();
  }
}

const mean = (values) => values.reduce((sum, v) => sum + v, 0) / values.length;
const median = (values) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)];

async function measure(client, { rollouts, blocks, sinkUrl }) {
  const plan = { endpoint: sinkUrl, serviceName: 'weather' };
  // Both paths warmed up (JIT) before anything counts.
  await block(client, rollouts, undefined);
  await block(client, rollouts, plan);
  const off = [];
  const on = [];
  for (let pair = 0; pair < blocks; pair += 1) {
    off.push(await block(client, rollouts, undefined));
    on.push(await block(client, rollouts, plan));
  }
  const differences = on.map((us, i) => us - off[i]);
  const spread = differences.reduce((sum, d) => sum + (d - mean(differences)) ** 2, 0);
  return {
    cpu_us_per_request: { off: median(off), on: median(on) },
    cpu_us_per_request_all_blocks: { off, on },
    tracing_us_per_request: mean(differences),
    tracing_us_per_request_standard_error: Math.sqrt(spread / (blocks - 1) / blocks),
  };
}

function report(figures) {
  const { off, on } = figures.cpu_us_per_request;
  console.log(
    `CPU µs per request (server and client), median block: off ${off.toFixed(1)}, on ${on.toFixed(1)}`,
  );
  const cost = figures.tracing_us_per_request.toFixed(1);
  const error = figures.tracing_us_per_request_standard_error.toFixed(1);
  console.log(
    `tracing_us_per_request ${cost} ± ${error} (mean of paired on − off blocks ± standard error)`,
  );
  console.log(
    `load average (1/5/15 min) at end: ${loadavg()
      .map((l) => l.toFixed(1))
      .join(' ')}`,
  );
}

if (process.argv[2] === SINK_CHILD) await runSinkChild();
else await main();
