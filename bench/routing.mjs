/* global Buffer, console, process, URL */
// What forwarding a session's request to the worker that owns it costs. Two worker processes,
// each the weather resources server (checkpointing off) with its session router, listening on a
// TCP port of its own and on its own socket in a shared runtime directory, as a server with
// `num_workers: 2` runs them. A session is seeded on worker A; its tool call (`/get_weather`) sent
// to A is served locally, sent to B it is forwarded to A over A's socket, streamed both ways.
// Blocks alternate local and forwarded, so the machine's load drifts alike over both.
//
// Per block: latency of sequential calls (one at a time: the hop's own latency, p50 and p99) and
// CPU per call of both workers together (their `process.cpuUsage`, asked over IPC) at 16 calls
// in flight. The figures are min / median / max over the blocks; the forwarded − local difference
// of the medians is the cost of the hop.
//
//   npm run build && npm run bench -- routing [--calls 2000] [--blocks 8]
//
// Writes bench/results/routing.json (or --out).
import { fork } from 'node:child_process';
import { once } from 'node:events';
import { mkdtempSync, rmSync } from 'node:fs';
import http from 'node:http';
import { loadavg } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import { listen, newRoutingId } from '@ckpt-gym/core/server';
import { createResourcesServer, weatherServer } from '@ckpt-gym/resources-server';

import { percentiles } from './lib/percentile.mjs';
import { benchFlags, integerFlag, nextMessage } from './lib/flags.mjs';
import { writeResult } from './lib/results.mjs';

const WORKER_CHILD = '--worker-child';
const CONCURRENCY = 16;
const SECRET = 'routing-bench-secret';

/** A child: one worker, its URL and routing id sent once it listens, its CPU whenever asked. */
async function runWorkerChild(socketDir) {
  const silent = { error() {}, warn() {}, info() {}, debug() {}, child: () => silent };
  const routingId = newRoutingId();
  const server = createResourcesServer(weatherServer(), {
    name: 'weather',
    checkpoint: undefined,
    logger: silent,
    sessionSecret: SECRET,
    routing: { routingId, socketDir },
  });
  await server.router.listen(server.app);
  const listening = await listen(server.app, 0);
  process.send({ url: listening.url, routingId });
  process.on('message', () => {
    const used = process.cpuUsage();
    process.send({ cpu_us: used.user + used.system });
  });
  process.once('disconnect', async () => {
    await server.router.close();
    await listening.close();
  });
}

async function cpuOf(children) {
  const replies = children.map(nextMessage);
  for (const child of children) child.send('cpu');
  return (await Promise.all(replies)).reduce((sum, r) => sum + r.cpu_us, 0);
}

async function main() {
  const flags = benchFlags(import.meta.url, {
    options: {
      calls: { type: 'string', default: '2000' },
      blocks: { type: 'string', default: '8' },
      out: { type: 'string' },
    },
  });
  const calls = integerFlag(flags, 'calls', 10);
  const blocks = integerFlag(flags, 'blocks', 2);
  const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
  const out = resolve(flags.out ?? join(repo, 'bench/results/routing.json'));
  const loadStart = loadavg();
  const socketDir = mkdtempSync('/tmp/cgb-');
  const children = [0, 1].map(() =>
    fork(fileURLToPath(import.meta.url), [WORKER_CHILD, socketDir]),
  );
  const agent = new http.Agent({ keepAlive: true, maxSockets: CONCURRENCY });
  try {
    const [a, b] = await Promise.all(children.map(nextMessage));
    const cookie = await seed(agent, a.url);
    const sessionId = Buffer.from(
      decodeURIComponent(cookie.split('=')[1]).split('.')[0],
      'base64url',
    );
    if (!sessionId.toString().startsWith(`${a.routingId}.`))
      throw new Error(`the session seeded on worker A does not name it: ${sessionId}`);
    const target = { local: a.url, forwarded: b.url };
    // Warm-up of both paths (JIT, pooled sockets) before anything counts.
    for (const path of ['local', 'forwarded']) await sequential(agent, target[path], cookie, calls);
    const figures = { local: [], forwarded: [] };
    for (let block = 0; block < blocks; block += 1) {
      for (const path of block % 2 === 0 ? ['local', 'forwarded'] : ['forwarded', 'local']) {
        figures[path].push(await measure(agent, children, target[path], cookie, calls));
      }
    }
    const summary = summarize(figures);
    report(summary);
    writeResult(out, 'routing', loadStart, {
      params: { calls_per_block: calls, blocks, concurrency: CONCURRENCY },
      ...summary,
      blocks: figures,
    });
    console.log(`wrote ${out}`);
  } finally {
    agent.destroy();
    for (const child of children) child.disconnect();
    await Promise.all(children.map((c) => once(c, 'exit')));
    rmSync(socketDir, { recursive: true, force: true });
  }
}

async function post(agent, base, path, body, cookie) {
  const data = JSON.stringify(body);
  const headers = {
    'content-type': 'application/json',
    'content-length': Buffer.byteLength(data),
    ...(cookie ? { cookie } : {}),
  };
  const req = http.request(new URL(path, base), { method: 'POST', agent, headers });
  req.end(data);
  const [res] = await once(req, 'response');
  const chunks = [];
  for await (const chunk of res) chunks.push(chunk);
  if (res.statusCode !== 200)
    throw new Error(`${path}: ${res.statusCode} ${Buffer.concat(chunks)}`);
  return res;
}

/** Seeds a session on the worker at `base`; its cookie names that worker. */
async function seed(agent, base) {
  const res = await post(agent, base, '/seed_session', {});
  return res.headers['set-cookie'][0].split(';')[0];
}

const call = (agent, base, cookie) =>
  post(agent, base, '/get_weather', { city: 'San Francisco' }, cookie);

/** Latencies (µs) of `count` calls one at a time. */
async function sequential(agent, base, cookie, count) {
  const latencies = [];
  for (let i = 0; i < count; i += 1) {
    const start = process.hrtime.bigint();
    await call(agent, base, cookie);
    latencies.push(Number(process.hrtime.bigint() - start) / 1000);
  }
  return latencies;
}

/** One block: sequential latency, then CPU per call of both workers at CONCURRENCY in flight. */
async function measure(agent, children, base, cookie, calls) {
  const latency = percentiles(await sequential(agent, base, cookie, calls));
  const before = await cpuOf(children);
  let left = calls;
  const lane = async () => {
    while (left-- > 0) await call(agent, base, cookie);
  };
  await Promise.all(Array.from({ length: CONCURRENCY }, lane));
  const cpu = (await cpuOf(children)) - before;
  return { p50_us: latency.p50, p99_us: latency.p99, cpu_us_per_call: cpu / calls };
}

function spread(values) {
  const sorted = [...values].sort((x, y) => x - y);
  return { min: sorted[0], median: sorted[Math.floor(sorted.length / 2)], max: sorted.at(-1) };
}

function summarize(figures) {
  const of = (path, key) => spread(figures[path].map((f) => f[key]));
  const summary = {};
  for (const path of ['local', 'forwarded']) {
    summary[path] = {
      p50_us: of(path, 'p50_us'),
      p99_us: of(path, 'p99_us'),
      cpu_us_per_call: of(path, 'cpu_us_per_call'),
    };
  }
  summary.hop = {
    p50_us: summary.forwarded.p50_us.median - summary.local.p50_us.median,
    cpu_us_per_call:
      summary.forwarded.cpu_us_per_call.median - summary.local.cpu_us_per_call.median,
  };
  return summary;
}

function report(summary) {
  const cell = (s) => `${s.min.toFixed(0)} / ${s.median.toFixed(0)} / ${s.max.toFixed(0)}`;
  console.log('per call (min / median / max over blocks)');
  console.log('path       latency p50 µs      latency p99 µs      CPU µs (both workers)');
  for (const path of ['local', 'forwarded']) {
    const s = summary[path];
    console.log(
      `${path.padEnd(10)} ${cell(s.p50_us).padEnd(19)} ${cell(s.p99_us).padEnd(19)} ${cell(s.cpu_us_per_call)}`,
    );
  }
  console.log(
    `the hop (forwarded − local, medians): p50 +${summary.hop.p50_us.toFixed(0)} µs, CPU +${summary.hop.cpu_us_per_call.toFixed(0)} µs per call`,
  );
  console.log(
    `load average (1/5/15 min) at end: ${loadavg()
      .map((l) => l.toFixed(1))
      .join(' ')}`,
  );
}

if (process.argv[2] === WORKER_CHILD) await runWorkerChild(process.argv[3]);
else await main();
