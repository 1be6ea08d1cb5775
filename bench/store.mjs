/* global AbortController, Buffer, console, performance, process */
// Record store benchmark: commit (writeParticipantState) and restore (readParticipantState) of N
// agent-session records of about S KB each, next to this machine's raw limits for the same bytes
// (sequential write + fsync, sequential read, SHA-256) and JSON.stringify / JSON.parse of the same
// records. Each row is the median of 3 runs; compare the ratios, which one run measures together.
//
//   npm run build && node bench/store.mjs [--records 1000] [--size 350] [--special]
//
// Many small records, as a whole stack's rollouts in flight give (SPEC §7: 8,000 of ~2 KB):
// `--records 8000 --size 2`. There the cost per record, not per byte, decides.
// --special puts a NaN and a bigint in every record, which takes the codec's exact (slower) path.
// Prints a table (wall and CPU seconds) and writes bench/results/store.json. Reads hit the page
// cache (the file was just written), as a restore right after a commit would; a restore after a
// reboot reads the disk. "First touch of fresh memory" is a floor for any restore that keeps its
// records: on some VMs new pages are expensive, and the restored records are new memory.
import { createHash } from 'node:crypto';
import { closeSync, fsyncSync, openSync, readSync, rmSync, writeSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { loadavg, tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';

import { benchFlags, refuse } from './lib/flags.mjs';
import { writeResult } from './lib/results.mjs';
import { AgentParticipant, AgentSessionTable, simpleAgent } from '@ckpt-gym/agent-server';
import { createHttpClients } from '@ckpt-gym/core/client';
import { encodeJson } from '@ckpt-gym/core/protocol';
import {
  appendEncoded,
  createLogger,
  readParticipantState,
  readRawParticipantState,
  RECORD_FIELDS_JSON,
  writeParticipantState,
} from '@ckpt-gym/core/server';

const flags = benchFlags(import.meta.url, {
  options: {
    records: { type: 'string', default: '1000' },
    size: { type: 'string', default: '350' },
    special: { type: 'boolean', default: false },
  },
});
const RECORDS = Number(flags.records);
const SIZE_KB = Number(flags.size);
const REPEATS = 3;
/** Issue 18's targets, for the default 1,000 records of 350 KB: twice NeMo Gym's speed here. */
const TARGETS = { commit_seconds: 0.7, restore_seconds: 0.8 };
const CHUNK = 8 << 20;
if (!(RECORDS > 0 && SIZE_KB > 0)) refuse('--records and --size must be positive numbers');

// --- realistic records: an agent session of ~100 messages -----------------------------------------

let seed = 0x2545f491;
function random() {
  // xorshift32: deterministic, fast, good enough for text
  seed ^= seed << 13;
  seed ^= seed >>> 17;
  seed ^= seed << 5;
  return (seed >>> 0) / 2 ** 32;
}
const WORDS = (
  'the of and to in is that for it as with was on be at by this had not are but from or have an ' +
  'they which one you were her all she there would their we him been has when who will more no if ' +
  'out so said what up its about into than them can only other new some could time these two may ' +
  'then do first any my now such like our over man me even most made after also did many before ' +
  'function return const value error result tool call weather forecast temperature ' +
  '"quoted" path/to/file.py line\tindent {"key": [1, 2]} \\escaped'
).split(' ');
/** Non-ASCII words are rare, so about a quarter of the messages hold one (and become two-byte strings). */
const RARE_WORDS = ['°C', 'café', 'naïve', 'résumé', '🙂', 'données', '→'];
function text(chars) {
  const parts = [];
  let length = 0;
  while (length < chars) {
    const pool = random() < 0.0005 ? RARE_WORDS : WORDS;
    const word = pool[Math.floor(random() * pool.length)];
    parts.push(word);
    length += word.length + 1;
    if (random() < 0.02) parts.push('\n');
  }
  return parts.join(' ');
}

function session(index, bytes) {
  const messages = [{ role: 'system', content: text(600) }];
  const perMessage = Math.max(200, Math.floor(bytes / 100));
  let size = 800;
  for (let turn = 0; size < bytes; turn++) {
    const kind = turn % 3;
    if (kind === 0) {
      messages.push({ role: 'user', content: text(perMessage * 0.6) });
    } else if (kind === 1) {
      messages.push({
        role: 'assistant',
        content: text(perMessage * 0.8),
        tool_calls: [
          {
            id: `call_${index}_${turn}`,
            type: 'function',
            function: { name: 'get_weather', arguments: `{"city": "Paris", "day": ${turn}}` },
          },
        ],
        usage: {
          input_tokens: 1200 + turn * 37,
          output_tokens: 80 + (turn % 17),
          latency_s: random() * 3,
        },
      });
    } else {
      const output = JSON.stringify({
        status: 'ok',
        rows: [text(perMessage * 0.5)],
        took_ms: turn * 3,
      });
      messages.push({ role: 'tool', tool_call_id: `call_${index}_${turn - 1}`, content: output });
    }
    size += JSON.stringify(messages[messages.length - 1]).length;
  }
  const record = {
    episode_id: { rollout_id: `bench-${index}`, attempt: 0 },
    boundary: { step: messages.length, activation: 1, reward: null, finished: false },
    session: { model: 'policy', temperature: 0.7, messages },
  };
  if (flags.special) record.boundary.metrics = { score: NaN, seed: 2n ** 64n + BigInt(index) };
  return record;
}

// --- measuring --------------------------------------------------------------------------------------

function median(values) {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)];
}

// Each run starts from a collected heap, as a fresh process would: no garbage of the run before.
setFlagsFromString('--expose-gc');
const collectGarbage = runInNewContext('gc');

/** Median wall and CPU (user + system, all threads) seconds of REPEATS runs of `run`. */
async function timed(run, prepare = async () => undefined) {
  const walls = [];
  const cpus = [];
  for (let i = 0; i < REPEATS; i++) {
    const state = await prepare();
    collectGarbage();
    const cpu = process.cpuUsage();
    const start = performance.now();
    await run(state);
    walls.push((performance.now() - start) / 1000);
    const used = process.cpuUsage(cpu);
    cpus.push((used.user + used.system) / 1e6);
  }
  return { seconds: median(walls), cpu_seconds: median(cpus) };
}

function rawWrite(path, bytes) {
  const fd = openSync(path, 'w');
  try {
    for (let offset = 0; offset < bytes.length; offset += CHUNK) {
      writeSync(fd, bytes, offset, Math.min(CHUNK, bytes.length - offset), offset);
    }
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}

function rawRead(path) {
  const fd = openSync(path, 'r');
  const buffer = Buffer.allocUnsafeSlow(CHUNK);
  let total = 0;
  try {
    for (let n; (n = readSync(fd, buffer, 0, CHUNK, total)) > 0;) total += n;
  } finally {
    closeSync(fd);
  }
  return total;
}

/** A commit of `records` into `dir`, as the bench's agent participant would write it. */
function commitInto(dir, records) {
  return writeParticipantState({
    checkpointDir: dir,
    kind: 'agent',
    instance: 'bench',
    checkpointId: 'bench',
    records,
  });
}

/**
 * A Simple Agent holding the records' sessions, each of their messages appended (encoded once) as
 * the agent appends what a session adds; then its participant's export, as a commit runs it.
 */
function agentHolding(records) {
  const sessions = new AgentSessionTable();
  const clients = createHttpClients();
  const agent = simpleAgent({
    name: 'bench',
    config: { model_server_url: 'http://127.0.0.1:9' }, // never called
    sessions,
    clients,
    logger: createLogger({ server: 'bench', kind: 'agent', level: 'error' }),
    checkpointing: true,
  });
  const participant = new AgentParticipant('bench', agent.hooks);
  const entries = records.map(({ episode_id, session, boundary }) => {
    const id = `session-${episode_id.rollout_id}`;
    const request = {
      agent_session_id: id,
      episode_id,
      task_id: 'bench',
      tool_accesses: [],
      sandbox_access: null,
    };
    const state = { toolAccess: null, resourcesCookies: null, observations: [] };
    // With --special, the NaN and bigint of the record's metrics are a message of their own.
    const messages = boundary.metrics ? [...session.messages, boundary.metrics] : session.messages;
    for (const message of messages) appendEncoded(state.observations, message);
    const entry = {
      id,
      request,
      fingerprint: '',
      episode: episode_id,
      activations: 1,
      completedActivation: 1,
      completedReply: null,
      closing: false,
      state,
    };
    sessions.set(entry);
    participant.openSession(id, episode_id);
    return entry;
  });
  return { participant, entries, close: () => clients.close() };
}

/** Times the agent's export of the records' sessions and their commit (each session changed since the last). */
async function timedAgentCommit(records, root) {
  const { participant, entries, close } = agentHolding(records);
  let run = 0;
  const signal = new AbortController().signal;
  try {
    return await timed(
      async (dir) => {
        const manifest = await commitInto(dir, await participant.export(null, signal));
        if (manifest.record_count !== records.length)
          throw new Error("the agent's commit wrote the wrong number of records");
      },
      async () => {
        await rm(join(root, `agent-${run - 1}`), { recursive: true, force: true });
        // A completed activation since the last commit: the sessions' states are exported anew.
        for (const entry of entries) entry.completedActivation = ++entry.activations;
        return join(root, `agent-${run++}`);
      },
    );
  } finally {
    await rm(join(root, `agent-${run - 1}`), { recursive: true, force: true });
    close();
  }
}

const loadStart = loadavg();
const root = await mkdtemp(join(tmpdir(), 'ckpt-gym-bench-store-'));
try {
  process.stdout.write(`generating ${RECORDS} records of ~${SIZE_KB} KB… `);
  const records = Array.from({ length: RECORDS }, (_, i) => session(i, SIZE_KB * 1024));
  console.log('done');

  let commitRun = 0;
  let manifest;
  const commit = await timed(
    async (dir) => {
      manifest = await commitInto(dir, records);
    },
    async () => {
      const dir = join(root, `commit-${commitRun++}`);
      await rm(join(root, `commit-${commitRun - 2}`), { recursive: true, force: true });
      return dir;
    },
  );
  if (manifest.record_count !== RECORDS)
    throw new Error('commit wrote the wrong number of records');
  // Encode once: each record carries its fields' JSON, as a participant that encoded its state
  // when it changed does; the commit then only writes and hashes.
  const preEncoded = records.map(({ episode_id, ...fields }) => ({
    episode_id,
    [RECORD_FIELDS_JSON]: Object.entries(fields).map(
      ([key, value], i) => `${i > 0 ? ',' : ''}${JSON.stringify(key)}:${encodeJson(value)}`,
    ),
  }));
  // The same pieces held as UTF-8 bytes (a message encoded once when it is added, kept as bytes):
  // the commit hashes and writes them, with no transcoding.
  const preEncodedBytes = preEncoded.map(({ episode_id, [RECORD_FIELDS_JSON]: pieces }) => ({
    episode_id,
    [RECORD_FIELDS_JSON]: pieces.map((piece) => Buffer.from(piece)),
  }));
  let preEncodedRun = 0;
  /** Times a commit of `encoded`, each run into a directory of its own (the last one removed). */
  const timedCommit = async (encoded) => {
    const row = await timed(
      async (dir) => {
        await commitInto(dir, encoded);
      },
      async () => {
        await rm(join(root, `encoded-${preEncodedRun - 1}`), { recursive: true, force: true });
        return join(root, `encoded-${preEncodedRun++}`);
      },
    );
    await rm(join(root, `encoded-${preEncodedRun - 1}`), { recursive: true, force: true });
    return row;
  };
  const commitPreEncoded = await timedCommit(preEncoded);
  const commitPreEncodedBytes = await timedCommit(preEncodedBytes);
  const commitAgent = await timedAgentCommit(records, root);
  const checkpointDir = join(root, `commit-${commitRun - 1}`);
  const recordsPath = join(checkpointDir, 'gym/agent/bench', manifest.records_file);

  /** Times a restore by `read` of the records `select` keeps, checking it kept `expected`. */
  const timedRestore = async (read, select, expected) => {
    let restored = [];
    const row = await timed(
      async () => {
        ({ records: restored } = await read({
          checkpointDir,
          kind: 'agent',
          instance: 'bench',
          select,
          validate: (record) => record,
        }));
      },
      async () => {
        restored = []; // dropped before the heap is collected
      },
    );
    if (restored.length !== expected) throw new Error('a restore read the wrong number of records');
    return row;
  };
  const restore = await timedRestore(readParticipantState, () => true, RECORDS);
  // A narrow scope: out-of-scope records are hashed and counted, never decoded.
  const restoreTenth = await timedRestore(
    readParticipantState,
    (key) => Number(key.slice('bench-'.length)) % 10 === 0,
    Math.ceil(RECORDS / 10),
  );
  // Decode on use: everything is verified, the payloads are decoded when an episode is first used.
  const restoreRaw = await timedRestore(readRawParticipantState, () => true, RECORDS);

  const fileBytes = Buffer.allocUnsafeSlow(rawRead(recordsPath));
  const fd = openSync(recordsPath, 'r');
  readSync(fd, fileBytes, 0, fileBytes.length, 0);
  closeSync(fd);
  const total = fileBytes.length;

  const rawPath = join(root, 'raw.bin');
  const writeFsync = await timed(async () => rawWrite(rawPath, fileBytes));
  rmSync(rawPath);
  const read = await timed(async () => rawRead(recordsPath));
  const sha256 = await timed(async () => createHash('sha256').update(fileBytes).digest('hex'));
  // What any restore that holds the records pays at least: first touch of as much new memory.
  const freshMemory = await timed(async () => Buffer.allocUnsafeSlow(total).fill(1));
  // JSON.stringify cannot write a bigint: the references use the records without their metrics.
  const plain = flags.special
    ? records.map(({ boundary: { metrics: _metrics, ...boundary }, ...record }) => ({
        ...record,
        boundary,
      }))
    : records;
  let length = 0;
  const stringify = await timed(async () => {
    for (const record of plain) length += JSON.stringify(record).length;
  });
  const lines = plain.map((record) => JSON.stringify(record));
  let parsed = [];
  const parse = await timed(
    async () => {
      parsed = lines.map((line) => JSON.parse(line)); // kept, as a restore keeps its records
    },
    async () => {
      parsed = [];
    },
  );
  if (parsed.length !== RECORDS || length === 0) throw new Error('the references did no work');
  parsed = [];

  const mb = total / 1e6;
  const rows = [
    { name: 'commit (writeParticipantState)', ...commit },
    { name: 'restore (readParticipantState, all)', ...restore },
    { name: 'restore, 1 in 10 records in scope', ...restoreTenth },
    { name: 'commit, fields pre-encoded', ...commitPreEncoded },
    { name: 'commit, fields pre-encoded as bytes', ...commitPreEncodedBytes },
    { name: "commit, the agent's export (encoded once)", ...commitAgent },
    { name: 'restore, decode on use (raw)', ...restoreRaw },
    { name: 'raw write + fsync', ...writeFsync },
    { name: 'raw read (page cache)', ...read },
    { name: 'sha256', ...sha256 },
    { name: 'first touch of fresh memory', ...freshMemory },
    { name: 'JSON.stringify (dropped)', ...stringify },
    { name: 'JSON.parse (kept)', ...parse },
  ].map((row) => ({ ...row, mb_per_s: mb / row.seconds }));
  const ratios = {
    commit_over_raw_write_fsync: commit.seconds / writeFsync.seconds,
    restore_over_raw_read: restore.seconds / read.seconds,
    commit_over_stringify_sha256_write_fsync:
      commit.seconds / (stringify.seconds + sha256.seconds + writeFsync.seconds),
    restore_over_read_sha256_parse:
      restore.seconds / (read.seconds + sha256.seconds + parse.seconds),
    // The same ratios in CPU seconds: steadier than wall time on a loaded machine.
    commit_cpu_over_stringify_sha256_write_fsync:
      commit.cpu_seconds / (stringify.cpu_seconds + sha256.cpu_seconds + writeFsync.cpu_seconds),
    pre_encoded_commit_cpu_over_sha256_write_fsync:
      commitPreEncoded.cpu_seconds / (sha256.cpu_seconds + writeFsync.cpu_seconds),
    byte_pieces_commit_cpu_over_sha256_write_fsync:
      commitPreEncodedBytes.cpu_seconds / (sha256.cpu_seconds + writeFsync.cpu_seconds),
    byte_pieces_commit_over_sha256_write_fsync:
      commitPreEncodedBytes.seconds / (sha256.seconds + writeFsync.seconds),
    agent_commit_over_sha256_write_fsync:
      commitAgent.seconds / (sha256.seconds + writeFsync.seconds),
    agent_commit_cpu_over_sha256_write_fsync:
      commitAgent.cpu_seconds / (sha256.cpu_seconds + writeFsync.cpu_seconds),
    restore_cpu_over_read_sha256_parse:
      restore.cpu_seconds / (read.cpu_seconds + sha256.cpu_seconds + parse.cpu_seconds),
    raw_restore_cpu_over_read_sha256:
      restoreRaw.cpu_seconds / (read.cpu_seconds + sha256.cpu_seconds),
    raw_restore_over_restore: restoreRaw.seconds / restore.seconds,
  };

  console.log(
    `\n${RECORDS} records, ${mb.toFixed(1)} MB (${(total / RECORDS / 1024).toFixed(0)} KB each)` +
      `${flags.special ? ', with NaN and bigint' : ''}; median of ${REPEATS}\n`,
  );
  console.log(
    `${'what'.padEnd(40)}${'seconds'.padStart(9)}${'cpu s'.padStart(9)}${'MB/s'.padStart(9)}`,
  );
  for (const row of rows) {
    const cells = [row.seconds.toFixed(3), row.cpu_seconds.toFixed(3), row.mb_per_s.toFixed(0)];
    console.log(`${row.name.padEnd(40)}${cells.map((cell) => cell.padStart(9)).join('')}`);
  }
  console.log('');
  for (const [name, value] of Object.entries(ratios))
    console.log(`${name.padEnd(50)}${value.toFixed(2)}`);
  const floors = {
    commit: stringify.seconds + sha256.seconds + writeFsync.seconds,
    // What a commit of bytes already encoded cannot go below: hash them, write them, sync.
    encoded_commit: sha256.seconds + writeFsync.seconds,
    restore: read.seconds + sha256.seconds + parse.seconds,
  };
  console.log(
    `\ncommit ${commit.seconds.toFixed(3)} s (floor stringify + sha256 + write ${floors.commit.toFixed(3)} s, ` +
      `target ≤ ${TARGETS.commit_seconds} s), restore ${restore.seconds.toFixed(3)} s (floor read + sha256 + ` +
      `parse ${floors.restore.toFixed(3)} s, target ≤ ${TARGETS.restore_seconds} s); the targets are for ` +
      '--records 1000 --size 350 on the 2-core machine',
  );
  console.log(
    `commit through the agent's export ${commitAgent.seconds.toFixed(3)} s (floor sha256 + write ` +
      `${floors.encoded_commit.toFixed(3)} s, target ≤ ${TARGETS.commit_seconds} s)`,
  );
  const load = (l) => l.map((x) => x.toFixed(1)).join(' ');
  console.log(
    `\nload average (1/5/15 min): ${load(loadStart)} at start, ${load(loadavg())} at end`,
  );

  const out = resolve(dirname(fileURLToPath(import.meta.url)), 'results', 'store.json');
  writeResult(out, 'store', loadStart, {
    params: {
      records: RECORDS,
      size_kb: SIZE_KB,
      special: flags.special,
      repeats: REPEATS,
      bytes: total,
    },
    rows,
    ratios,
    floors_seconds: floors,
    targets: TARGETS,
  });
  console.log(`\nwrote ${out}`);
} finally {
  await rm(root, { recursive: true, force: true });
}
