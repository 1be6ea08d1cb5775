/* global Buffer, console, process, URL */
// The admission gate's cost on one server, without the rest of the stack's noise: the weather
// resources server alone (started by the CLI's launcher), checkpointing off and on, driven with a
// rollout's four requests (native seed, tool call, verify, native close) as the environment and
// the agent send them, 16 rollouts at a time over keep-alive sockets. Per stack: the server's CPU
// per rollout (from /proc). Rounds alternate the order; the figure is the ratio of the medians.
// The throughput bench's `checkpoint_on_over_off` is the whole stack's figure; this one shows what
// checkpointing adds per request on one server, where a change to the gate shows up.
//
//   npm run build && npm run bench -- gate [--rollouts 3000] [--rounds 3]
//
// Prints the figures and writes bench/results/gate.json (or --out).
import { writeFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import http from 'node:http';
import { loadavg, tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import { launchStack } from '@ckpt-gym/coordinator-cli';

import { benchFlags, integerFlag } from './lib/flags.mjs';
import { writeResult } from './lib/results.mjs';
import { serverCpuMs } from './lib/stack.mjs';

const flags = benchFlags(import.meta.url, {
  options: {
    rollouts: { type: 'string', default: '3000' },
    rounds: { type: 'string', default: '3' },
    out: { type: 'string' },
  },
});
const ROLLOUTS = integerFlag(flags, 'rollouts', 1);
const ROUNDS = integerFlag(flags, 'rounds', 1);
const CONCURRENCY = 16;
const WARMUP = 300;
const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const OUT = resolve(flags.out ?? join(repo, 'bench/results/gate.json'));
const sockets = new http.Agent({ keepAlive: true, maxSockets: CONCURRENCY });

/** POSTs JSON; its status, body and the session cookie it set. */
function post(base, path, body, cookie) {
  const data = JSON.stringify(body);
  const headers = { 'content-type': 'application/json', 'content-length': Buffer.byteLength(data) };
  if (cookie) headers.cookie = cookie;
  return new Promise((done, fail) => {
    const req = http.request(new URL(path, base), { method: 'POST', agent: sockets, headers });
    req.once('response', (res) => {
      const chunks = [];
      res.on('data', (chunk) => chunks.push(chunk));
      res.on('end', () => {
        const text = Buffer.concat(chunks).toString('utf8');
        if (res.statusCode !== 200) fail(new Error(`${path}: ${res.statusCode} ${text}`));
        else done({ cookie: res.headers['set-cookie']?.[0]?.split(';')[0] ?? cookie });
      });
    });
    req.once('error', fail);
    req.end(data);
  });
}

/** One rollout's requests; the tool call names its attempt only with checkpointing on. */
async function rollout(base, id, checkpoint) {
  const prefix = `/ng-rollout/${id}`;
  const episode_id = { rollout_id: id, attempt: 0 };
  const session = { resources_session_id: `session-${id}`, episode_id };
  const task = { task_id: { taskset: 'gate', task_id: 'weather-sf' }, task_data: {} };
  const { cookie } = await post(base, `${prefix}/seed_session`, { ...session, ...task });
  await post(base, `${checkpoint ? prefix : ''}/get_weather`, { city: 'San Francisco' }, cookie);
  const answer = {
    output: [{ type: 'message', content: [{ type: 'output_text', text: 'sunny' }] }],
  };
  await post(base, `${prefix}/verify`, { response: answer, verification_input: {} }, cookie);
  await post(base, `${prefix}/close_session`, session, cookie);
}

async function runRollouts(base, prefix, count, checkpoint) {
  let next = 0;
  const worker = async () => {
    while (next < count) await rollout(base, `${prefix}-${next++}`, checkpoint);
  };
  await Promise.all(Array.from({ length: CONCURRENCY }, worker));
}

/** The weather server's CPU ms per rollout in one stack. */
async function measure(checkpoint, round) {
  const runDir = await mkdtemp(join(tmpdir(), 'ckpt-gym-gate-'));
  const source = join(runDir, 'stack.source.yaml');
  const checkpointing = checkpoint ? 'checkpoint: { enabled: true, control_auth_token: t }\n' : '';
  writeFileSync(
    source,
    `${checkpointing}servers:\n  weather: { kind: resources, app: weather, port: 0 }\n`,
  );
  const handle = await launchStack({ configPath: source, runDir, env: process.env });
  try {
    const base = handle.servers.get('weather').url;
    await runRollouts(base, `warmup-${round}`, WARMUP, checkpoint);
    const before = serverCpuMs(handle).total.weather;
    await runRollouts(base, `r-${round}`, ROLLOUTS, checkpoint);
    return (serverCpuMs(handle).total.weather - before) / ROLLOUTS;
  } finally {
    await handle.stop({ graceMs: 2000 }).catch(() => undefined);
    await rm(runDir, { recursive: true, force: true });
  }
}

const median = (values) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)];
const loadStart = loadavg();
const cpu = { off: [], on: [] };
for (let round = 0; round < ROUNDS; round += 1) {
  for (const checkpoint of round % 2 ? [true, false] : [false, true]) {
    cpu[checkpoint ? 'on' : 'off'].push(await measure(checkpoint, round));
  }
}
const figures = {
  cpu_ms_per_rollout: { off: median(cpu.off), on: median(cpu.on) },
  cpu_ms_per_rollout_all_rounds: cpu,
  cpu_on_over_off: median(cpu.on) / median(cpu.off),
};
for (const side of ['off', 'on']) {
  const all = cpu[side].map((ms) => ms.toFixed(3)).join(' ');
  console.log(
    `weather CPU ms per rollout, checkpoint ${side}: median ${figures.cpu_ms_per_rollout[side].toFixed(3)} (rounds ${all})`,
  );
}
console.log(`cpu_on_over_off ${figures.cpu_on_over_off.toFixed(3)}`);
console.log(`load average (1/5/15 min): ${loadStart.map((l) => l.toFixed(1)).join(' ')} at start`);
writeResult(OUT, 'gate', loadStart, {
  params: { rollouts: ROLLOUTS, rounds: ROUNDS, concurrency: CONCURRENCY },
  ...figures,
});
console.log(`wrote ${OUT}`);
sockets.destroy();
