/* global Buffer, console, fetch, performance, process, setImmediate */
// Control plane benchmark: prepare, commit and restore of N in-memory episodes through the real
// control routes over loopback (bearer auth, JSON bodies, one validation, the plane, the record
// store), with a minimal in-memory participant. Prepare parks the in-flight episodes in batches
// after admission closes, so it measures the readiness wait woken by change notifications; commit
// names every episode in its scope; restore runs in a fresh plane and participant, as after a crash.
// Each row is the median of 3 runs; compare ratios, which one run measures together.
//
//   npm run build -w @ckpt-gym/core && node bench/control.mjs [--episodes 100000] [--payload 200]
//
// Prints a table and writes bench/results/control.json.
import { once } from 'node:events';
import { mkdirSync, writeFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { cpus, tmpdir, totalmem } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import { captureKey, CONTROL_VALIDATORS, nextAttempt } from '@ckpt-gym/core/protocol';
import {
  BaseParticipant,
  ControlPlane,
  createLogger,
  errorMiddleware,
  installControlPlane,
  prepareReport,
} from '@ckpt-gym/core/server';
import express from 'express';

import { benchFlags, refuse } from './lib/flags.mjs';

const flags = benchFlags(import.meta.url, {
  options: {
    episodes: { type: 'string', default: '100000' },
    payload: { type: 'string', default: '200' },
  },
});
const EPISODES = Number(flags.episodes);
const PAYLOAD_BYTES = Number(flags.payload);
const REPEATS = 3;
const TOKEN = 'bench-token';
/** Episodes reaching their boundary per event-loop turn once admission closed. */
const PARK_BATCH = 5000;
if (!(EPISODES > 0 && PAYLOAD_BYTES >= 0)) refuse('--episodes and --payload must be positive');

/** Episodes in flight in memory: running until admission closes, then parking in batches. */
class BenchParticipant extends BaseParticipant {
  constructor(episodes) {
    super('environment', 'bench');
    this.boundaries = new Map();
    this.restored = new Map();
    this.running = 0;
    const filler = 'x'.repeat(PAYLOAD_BYTES);
    for (let i = 0; i < episodes; i++) {
      this.boundaries.set(`r${i}`, {
        episode_id: { rollout_id: `r${i}`, attempt: 0 },
        boundary: { step: i % 17, text: filler },
      });
    }
  }

  /** Every episode is mid-step: it parks at its next boundary once admission closes. */
  startAll() {
    this.running = this.boundaries.size;
  }

  async closeAdmission() {
    const park = () => {
      this.running = Math.max(0, this.running - PARK_BATCH);
      this.notifyChange();
      if (this.running > 0) setImmediate(park);
    };
    setImmediate(park);
  }

  async openAdmission() {}

  ready() {
    return this.running === 0;
  }

  readiness() {
    return prepareReport({
      blockers: [],
      blockerCount: this.running,
      counts: { episodes: this.boundaries.size },
    });
  }

  async export(scope) {
    const records = [];
    for (const e of scope ?? []) {
      const key = captureKey(e);
      const record = this.boundaries.get(key) ?? this.restored.get(key);
      if (record) records.push(record);
    }
    return records;
  }

  validateRecord(record) {
    if (typeof record.boundary !== 'object' || record.boundary === null)
      throw new Error('no boundary');
    return record;
  }

  async install(records) {
    for (const record of records) {
      const next = nextAttempt(record.episode_id);
      this.restored.set(captureKey(next), { ...record, episode_id: next });
    }
  }

  restoredPending() {
    return [...this.restored.values()].map((r) => r.episode_id);
  }

  async retire() {}
}

const silent = createLogger({ level: 'error' });

async function serve(participant) {
  const plane = new ControlPlane(participant, { leaseGraceSeconds: 600, logger: silent });
  const app = express();
  installControlPlane(app, plane, TOKEN);
  app.use(errorMiddleware(silent));
  const server = app.listen(0, '127.0.0.1');
  await once(server, 'listening');
  const base = `http://127.0.0.1:${server.address().port}/ng-control/v1/checkpoint`;
  return {
    base,
    close() {
      plane.dispose();
      server.closeAllConnections();
      server.close();
    },
  };
}

async function post(base, route, body) {
  const text = JSON.stringify(body);
  const started = performance.now();
  const response = await fetch(`${base}/${route}`, {
    method: 'POST',
    headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
    body: text,
  });
  const reply = await response.json();
  const ms = performance.now() - started;
  if (response.status !== 200)
    throw new Error(`${route}: HTTP ${response.status} ${JSON.stringify(reply)}`);
  return { ms, reply, requestBytes: Buffer.byteLength(text) };
}

const deadline = () => Date.now() / 1000 + 120;
const scope = Array.from({ length: EPISODES }, (_, i) => ({ rollout_id: `r${i}`, attempt: 0 }));

async function runOnce(root, run) {
  const dir = join(root, `ckpt-${run}`);
  const id = `bench-${run}`;
  const participant = new BenchParticipant(EPISODES);
  participant.startAll();
  const gym = await serve(participant);
  const rows = {};
  try {
    const prepare = await post(gym.base, 'prepare', { checkpoint_id: id, deadline_ts: deadline() });
    if (prepare.reply.phase !== 'prepared')
      throw new Error(`prepare replied ${prepare.reply.phase}`);
    rows.prepare = prepare;
    const commit = await post(gym.base, 'commit', {
      checkpoint_id: id,
      deadline_ts: deadline(),
      checkpoint_dir: dir,
      episode_ids: scope,
    });
    if (commit.reply.episode_ids.length !== EPISODES)
      throw new Error('commit exported the wrong episodes');
    rows.commit = commit;
    rows.resume = await post(gym.base, 'resume', { checkpoint_id: id, deadline_ts: deadline() });
  } finally {
    gym.close();
  }
  // A fresh process after a crash: a new plane and participant, nothing in flight.
  const fresh = await serve(new BenchParticipant(0));
  try {
    const restore = await post(fresh.base, 'restore', {
      checkpoint_id: `${id}-restore`,
      deadline_ts: deadline(),
      checkpoint_dir: dir,
      episode_ids: scope,
    });
    if (restore.reply.restored.length !== EPISODES)
      throw new Error('restore installed the wrong episodes');
    rows.restore = restore;
  } finally {
    fresh.close();
  }
  // The cost of validating the commit body alone, in process.
  const body = {
    checkpoint_id: id,
    deadline_ts: deadline(),
    checkpoint_dir: dir,
    episode_ids: scope.map((e) => ({ ...e })),
  };
  const started = performance.now();
  CONTROL_VALIDATORS.commit(body);
  rows['validate commit body'] = {
    ms: performance.now() - started,
    requestBytes: Buffer.byteLength(JSON.stringify(body)),
  };
  return rows;
}

const median = (values) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)];

const root = await mkdtemp(join(tmpdir(), 'ckpt-bench-control-'));
const runs = [];
try {
  for (let run = 0; run < REPEATS; run++) runs.push(await runOnce(root, run));
} finally {
  await rm(root, { recursive: true, force: true });
}

const operations = Object.keys(runs[0]);
const results = operations.map((op) => {
  const times = runs.map((r) => r[op].ms);
  return {
    operation: op,
    median_ms: Math.round(median(times) * 10) / 10,
    min_ms: Math.round(Math.min(...times) * 10) / 10,
    request_bytes: runs[0][op].requestBytes,
  };
});

console.log(
  `control plane over loopback: ${EPISODES} episodes, ${PAYLOAD_BYTES} B payload each, median of ${REPEATS}`,
);
console.log(
  `${'operation'.padEnd(22)}${'median ms'.padStart(12)}${'min ms'.padStart(10)}${'request'.padStart(12)}`,
);
for (const r of results) {
  console.log(
    `${r.operation.padEnd(22)}${r.median_ms.toFixed(1).padStart(12)}${r.min_ms.toFixed(1).padStart(10)}${`${(r.request_bytes / 1e6).toFixed(2)} MB`.padStart(12)}`,
  );
}

const out = resolve(dirname(fileURLToPath(import.meta.url)), 'results', 'control.json');
mkdirSync(dirname(out), { recursive: true });
writeFileSync(
  out,
  `${JSON.stringify(
    {
      benchmark: 'control',
      date: new Date().toISOString(),
      node: process.version,
      cpus: cpus().length,
      memory_gib: Math.round(totalmem() / 2 ** 30),
      episodes: EPISODES,
      payload_bytes: PAYLOAD_BYTES,
      repeats: REPEATS,
      results,
    },
    null,
    2,
  )}\n`,
);
console.log(`wrote ${out}`);
