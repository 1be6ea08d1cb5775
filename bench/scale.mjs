/* global console, performance, process, setTimeout */
// Scale: N rollouts all in flight on a real stack (separate processes started by the CLI's
// launcher: fake backend, policy model with token capture, weather resources, Simple Agent,
// single_agent_turn environment), each held at its second model call
// (`after_calls_per_rollout: 1`). Then: prepare stage by stage and as a whole, commit, crash (SIGKILL
// of every gym process group; the backend lives on), restart, restore, resume, and every exported
// rollout's replacement. Checks that every rollout either finished before the checkpoint or was
// exported, and that every exported one finishes (reward 1.0) after the restore. Last, the restore
// floor of the same checkpoint (lib/floor.mjs): the least any restore of it could take here.
//
//   npm run build && npm run bench -- scale --rollouts 8000 [--policy-workers 2]
//   npm run build && npm run bench -- scale --rollouts 16000 --policy-workers 4 --agent-workers 4 \
//     --env-workers 4
//
// `--profile-restore DIR` writes each process's CPU profile over the restore (`<pid>.cpuprofile`)
// into DIR; `--profile-commit DIR` the same over the commit (with both, both go into the commit's
// DIR: the restored processes are new ones, with pids of their own); `--profile-replacements DIR`
// the same over the replacements (the profiles' pids are printed with their processes' names).
// `--policy-workers N` runs the policy model as a primary and N workers (`num_workers: N`);
// `--agent-workers`, `--env-workers` and `--resources-workers` the same for the other kinds. Each
// in-flight rollout holds about two descriptors in the policy, agent and environment processes (a
// caller's socket and its own call out): pick worker counts so no gym process holds more than 60 %
// of its descriptor limit (checked, `fds_le_60_pct`). The targets are issue 18's up to 8,000
// rollouts and issue 20's above. Prints per-stage times and every process's descriptors and CPU
// (each worker beside the other processes), and writes bench/results/scale.json (with N workers:
// scale-policy-workers-N.json; or --out). `--commit-only` stops after the commit (no crash, restore
// or replacements): it prints the commit's figures and writes nothing.
import { mkdirSync, readdirSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { cpus, tmpdir, totalmem } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import { freePort, launchStack } from '@ckpt-gym/coordinator-cli';
import {
  commit,
  createHttpClients,
  createParticipants,
  getControl,
  prepare,
  restore,
  resume,
} from '@ckpt-gym/core/client';
import { parseCaptureKey } from '@ckpt-gym/core/protocol';
import { PREPARE_ORDER } from '@ckpt-gym/core/server';

import { benchFlags, integerFlag } from './lib/flags.mjs';
import { restoreFloor } from './lib/floor.mjs';
import { forwardAndAccessLines, forwardWaits, printForwardWaits } from './lib/forwards.mjs';
import { netdevMaxBacklog, networkCounters, networkCountersSince } from './lib/network.mjs';
import { cpuProfileEnv, toggleProfilesOf } from './lib/profile.mjs';
import {
  cpuByServer,
  descriptorLimit,
  processLabel,
  sampleCpu,
  sampleMembers,
  stackMembers,
} from './lib/processes.mjs';
import { difference, episodeBody } from './lib/stack.mjs';

const flags = benchFlags(import.meta.url, {
  options: {
    rollouts: { type: 'string', default: '1000' },
    out: { type: 'string' },
    'keep-dir': { type: 'boolean', default: false },
    'policy-workers': { type: 'string', default: '1' },
    'agent-workers': { type: 'string', default: '1' },
    'env-workers': { type: 'string', default: '1' },
    'resources-workers': { type: 'string', default: '1' },
    'profile-restore': { type: 'string' },
    'profile-commit': { type: 'string' },
    'profile-replacements': { type: 'string' },
    'commit-only': { type: 'boolean', default: false },
  },
});
const ROLLOUTS = integerFlag(flags, 'rollouts', 1);
const WORKERS = {
  policy: integerFlag(flags, 'policy-workers', 1),
  simple_agent: integerFlag(flags, 'agent-workers', 1),
  env: integerFlag(flags, 'env-workers', 1),
  weather: integerFlag(flags, 'resources-workers', 1),
};
const POLICY_WORKERS = WORKERS.policy;
const OTHER_WORKERS = Object.entries(WORKERS).filter(([name, n]) => name !== 'policy' && n > 1);
/** Issue 18's targets up to 8,000 rollouts in flight, issue 20's (16,000) above. */
const LIMITS_S =
  ROLLOUTS > 8000
    ? { prepare: 2, commit: 2, restore: 3 }
    : { prepare: 0.3, commit: 0.3, restore: 0.5 };
const FDS_SHARE = 0.6;
const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const OUT = resolve(
  flags.out ??
    join(
      repo,
      OTHER_WORKERS.length > 0
        ? `bench/results/scale-${ROLLOUTS}-workers-${Object.values(WORKERS).join('-')}.json`
        : POLICY_WORKERS === 1
          ? 'bench/results/scale.json'
          : `bench/results/scale-policy-workers-${POLICY_WORKERS}.json`,
    ),
);
const TOKEN = 'bench-scale-token';
const DEADLINE_S = 300;
/** No new model call for this long while rollouts are still short of their second: give up. */
const STALL_MS = 60_000;

const now = () => performance.now();
const seconds = (from) => Date.now() / 1000 + from;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const round = (ms) => Math.round(ms) / 1000;

function stackYaml(inferencePort) {
  return `checkpoint: { enabled: true, control_auth_token: ${TOKEN}, lease_grace_seconds: 600 }
token_capture: { enabled: true, dir: ./capture }
servers:
  inference: { kind: inference, app: fake, port: ${inferencePort}, script: weather }
  policy: { kind: model, app: policy, port: 0, num_workers: ${POLICY_WORKERS}, backend_url: "http://127.0.0.1:${inferencePort}/v1", checkpoint_policy: true, checkpoint_generation_cuts: true }
  weather: { kind: resources, app: weather, port: 0, num_workers: ${WORKERS.weather} }
  simple_agent: { kind: agent, app: simple, port: 0, num_workers: ${WORKERS.simple_agent}, model_server: policy, resources_server: weather }
  env: { kind: environment, app: single_agent_turn, port: 0, num_workers: ${WORKERS.env}, agent_server: simple_agent, resources_server: weather }
`;
}

function bytesUnder(dir) {
  let total = 0;
  let entries;
  try {
    entries = readdirSync(dir, { withFileTypes: true });
  } catch {
    return 0;
  }
  for (const entry of entries) {
    const path = join(dir, entry.name);
    total += entry.isDirectory() ? bytesUnder(path) : statSync(path).size;
  }
  return total;
}

/**
 * What each server (all its processes, `members`) spent of the CPU while `fn` ran, and in all (2
 * cores = 2 s of CPU a second); `kernel` is the system-time share (file and socket work in the
 * kernel); `by_process` each process's samples before and after.
 */
async function cpuDuring(members, fn) {
  // CPU only: counting descriptors here would put tens of ms of /proc listing into the timing.
  const before = sampleMembers(members, sampleCpu);
  const value = await fn();
  const after = sampleMembers(members, sampleCpu);
  const [from, to] = [cpuByServer(before), cpuByServer(after)];
  return {
    value,
    spent: difference(from.total, to.total),
    kernel: difference(from.kernel, to.kernel),
    by_process: { before, after },
  };
}

/**
 * Waits until `members` together spend at most `idleMs` of CPU in `stepMs` (what they burn holding
 * every rollout with nothing to do is ~10-60 ms a second), or `maxMs` passed.
 */
async function untilIdle(members, { stepMs = 250, idleMs = 25, maxMs = 15_000 } = {}) {
  const total = () => sampleMembers(members, sampleCpu).reduce((sum, row) => sum + row.cpu_ms, 0);
  const until = now() + maxMs;
  let last = total();
  while (now() < until) {
    await sleep(stepMs);
    const next = total();
    if (next - last <= idleMs) return;
    last = next;
  }
}

/** Each worker's index by server and pid, as the servers' status replies list their workers. */
async function workerIndexes(handle, clients) {
  const byServer = {};
  for (const server of handle.servers.values()) {
    if (server.kind === 'inference') continue;
    const status = await getControl(
      clients.control,
      `${server.url}/ng-control/v1/checkpoint/status`,
      {
        token: TOKEN,
      },
    );
    byServer[server.name] = new Map((status.workers ?? []).map((w) => [w.pid, w.index]));
  }
  return (name, pid) => byServer[name]?.get(pid);
}

/**
 * Every process at `held` (every rollout in flight): its descriptors and CPU so far, and the CPU
 * it spent during the commit (`commit`: cpuDuring's samples).
 */
function processTable(held, commit) {
  const change = (row, field) => {
    const after = commit.after.find((a) => a.pid === row.pid);
    const before = commit.before.find((b) => b.pid === row.pid);
    return after && before ? Math.round(after[field] - before[field]) : null;
  };
  return held.map((row) => ({
    process: processLabel(row),
    pid: row.pid,
    fds: row.fds,
    fds_limit: descriptorLimit(row.pid) ?? null,
    rss_mib: row.rss_mib,
    cpu_ms: Math.round(row.cpu_ms),
    commit_cpu_ms: change(row, 'cpu_ms'),
    // Kernel time and page faults in the commit: first touch of fresh memory shows here.
    commit_kernel_ms: change(row, 'kernel_ms'),
    commit_minflt: change(row, 'minflt'),
    commit_majflt: change(row, 'majflt'),
  }));
}

/**
 * The commit's wall time against its slowest participant's own total (`serverTimings`): what the
 * controller's side, the request and reply, and the servers' wait for a core add around the work.
 */
function commitOverSlowest(commitS, timings) {
  const totals = Object.entries(timings)
    .map(([server, entries]) => [server, entries['committed scale-c1']?.total_ms])
    .filter(([, ms]) => typeof ms === 'number')
    .sort((a, b) => b[1] - a[1]);
  if (totals.length === 0) return null;
  const [server, total_ms] = totals[0];
  return { slowest: server, total_ms, outside_ms: Math.round(commitS * 1000 - total_ms) };
}

/**
 * Where each server's forwards between its workers waited (`lib/forwards.mjs`), for the servers
 * whose logs have forward lines (CKPT_GYM_LOG_LEVEL=debug and several workers).
 */
function stackForwardWaits(handle) {
  const byServer = {};
  for (const server of handle.servers.values()) {
    let lines;
    try {
      lines = forwardAndAccessLines(server.logPath);
    } catch {
      continue;
    }
    const waits = forwardWaits(lines);
    if (Object.keys(waits).length > 0) byServer[server.name] = waits;
  }
  return byServer;
}

/**
 * Each server's own account of the checkpoint (its 'checkpoint committed' / 'checkpoint restored'
 * log lines): where the commit and restore time went, per server.
 */
function serverTimings(handle) {
  const timings = {};
  for (const server of handle.servers.values()) {
    if (server.kind === 'inference') continue;
    let text;
    try {
      text = readFileSync(server.logPath, 'utf8');
    } catch {
      continue;
    }
    for (const line of text.split('\n')) {
      if (!line.includes('"checkpoint committed"') && !line.includes('"checkpoint restored"'))
        continue;
      let entry;
      try {
        entry = JSON.parse(line);
      } catch {
        continue;
      }
      const { message, checkpoint_id: id, records, ...rest } = entry;
      const ms = Object.fromEntries(Object.entries(rest).filter(([k]) => k.endsWith('_ms')));
      timings[server.name] ??= {};
      timings[server.name][`${message.split(' ')[1]} ${id}`] = { records, ...ms };
    }
  }
  return timings;
}

/**
 * Each server's own timings, the commit's time outside its slowest participant, the CPU of each
 * server during the idle second, the commit (and restore), and each process's table row.
 */
function printCommit(commitS, timingsMs, cpuMs, processes) {
  console.log('\nSERVER          CHECKPOINT           RECORDS  TIMES (ms)');
  for (const [name, entries] of Object.entries(timingsMs)) {
    for (const [what, { records, ...ms }] of Object.entries(entries)) {
      const times = Object.entries(ms)
        .map(([k, v]) => `${k.replace(/_ms$/, '')} ${v}`)
        .join(', ');
      console.log(`${name.padEnd(15)} ${what.padEnd(20)} ${String(records).padStart(7)}  ${times}`);
    }
  }
  const over = commitOverSlowest(commitS, timingsMs);
  if (over !== null) {
    console.log(
      `commit ${commitS} s: slowest participant ${over.slowest} ${over.total_ms} ms ` +
        `by its own total, ${over.outside_ms} ms outside the participants' work`,
    );
  }
  for (const [what, spent] of Object.entries(cpuMs)) {
    console.log(`CPU during ${what} (ms): ${JSON.stringify(spent)}`);
  }
  console.log(
    '\nPROCESS (every rollout held)     PID     FDS  OF LIMIT  RSS (MiB)  CPU SO FAR (ms)  CPU IN COMMIT (ms)' +
      '  KERNEL IN COMMIT (ms)  FAULTS IN COMMIT (minor/major)',
  );
  for (const row of processes) {
    console.log(
      `${row.process.padEnd(30)} ${String(row.pid).padStart(7)} ${String(row.fds).padStart(7)}` +
        `  ${(row.fds_limit ? `${Math.round((100 * row.fds) / row.fds_limit)} %` : '-').padStart(8)}` +
        `  ${String(row.rss_mib ?? '-').padStart(9)}` +
        `  ${String(row.cpu_ms).padStart(15)}  ${String(row.commit_cpu_ms ?? '-').padStart(18)}` +
        `  ${String(row.commit_kernel_ms ?? '-').padStart(21)}` +
        `  ${`${row.commit_minflt ?? '-'}/${row.commit_majflt ?? '-'}`.padStart(30)}`,
    );
  }
}

async function main() {
  const runDir = await mkdtemp(join(tmpdir(), 'ckpt-gym-scale-'));
  const networkBefore = networkCounters();
  const source = join(runDir, 'stack.source.yaml');
  // The backend's port is fixed up front: the policy model names it by URL.
  writeFileSync(source, stackYaml(await freePort('127.0.0.1')));
  const clients = createHttpClients({
    data: { maxSockets: 0, maxTotalSockets: 0 },
    control: { maxSockets: 0, maxTotalSockets: 0 },
  });
  const timings = {};
  const time = async (name, fn) => {
    const start = now();
    const value = await fn();
    timings[name] = round(now() - start);
    console.error(`${name}: ${timings[name]} s`);
    return value;
  };
  const profiles = flags['profile-restore'] && resolve(flags['profile-restore']);
  const commitProfiles = flags['profile-commit'] && resolve(flags['profile-commit']);
  const replacementProfiles =
    flags['profile-replacements'] && resolve(flags['profile-replacements']);
  for (const dir of [profiles, commitProfiles, replacementProfiles])
    if (dir) mkdirSync(dir, { recursive: true });
  const profileDir = commitProfiles ?? profiles ?? replacementProfiles;
  const env = profileDir ? { ...process.env, ...cpuProfileEnv(profileDir) } : undefined;
  const handle = await time('launch', () =>
    launchStack({ configPath: source, runDir, ...(env ? { env } : {}) }),
  );
  // Interrupted: no server outlives the benchmark.
  for (const signal of ['SIGINT', 'SIGTERM']) {
    process.once(signal, () => {
      handle.crash({ all: true }).finally(() => process.exit(130));
    });
  }
  try {
    const url = (name) => handle.servers.get(name).url;
    const backend = (path, body) =>
      body === undefined
        ? clients.data(`${url('inference')}${path}`, { retry: { limit: 0 } }).json()
        : clients.data
            .post(`${url('inference')}${path}`, { json: body, retry: { limit: 0 } })
            .json();
    const participants = () =>
      createParticipants(
        [...handle.servers.values()]
          .filter((s) => s.kind !== 'inference')
          .map((s) => ({ server: s.name, kind: s.kind, url: s.url })),
        { token: TOKEN, clients },
      );
    const ids = Array.from({ length: ROLLOUTS }, (_, i) => `scale-${i}`);
    const run = (id, attempt) =>
      clients.data
        .post(`${url('env')}/run`, {
          json: episodeBody(id, attempt),
          retry: { limit: 0 },
          throwHttpErrors: false,
          timeout: { request: 900_000 },
        })
        .then((res) => ({ status: res.statusCode, body: JSON.parse(res.body) }))
        .catch((err) => ({ status: 0, body: { error: String(err) } }));

    await backend('/_ctl/hold', { after_calls_per_rollout: 1 });
    const finishedBefore = new Set();
    const failedBefore = new Map();
    const first = ids.map((id) =>
      run(id, 0).then((reply) => {
        if (reply.status === 200 && reply.body.result?.reward === 1) finishedBefore.add(id);
        else if (reply.status !== 0) failedBefore.set(id, reply.body.failure ?? reply.body.error);
        return reply;
      }),
    );
    // Every rollout still running waits at its second call; one that replied makes no more.
    await time('dispatch_to_all_held', async () => {
      let last = -1;
      let lastStatuses = '';
      let progressAt = Date.now();
      const statusesNow = () =>
        Promise.all(
          [...handle.servers.values()]
            .filter((s) => s.kind !== 'inference')
            .map((s) =>
              getControl(clients.control, `${s.url}/ng-control/v1/checkpoint/status`, {
                token: TOKEN,
              }).then((st) => `${s.name}: ${JSON.stringify(st.report.counts)}`),
            ),
        );
      for (;;) {
        // Held means waiting at the backend now: a count of calls made includes retried ones.
        const { count, waiting } = await backend('/_ctl/call_count');
        const replied = finishedBefore.size + failedBefore.size;
        if (waiting >= ROLLOUTS - replied) return;
        if (count !== last) [last, progressAt] = [count, Date.now()];
        if (Date.now() - progressAt > STALL_MS) {
          // Sessions seeded before the first model call are progress too (a loaded machine).
          const statuses = await statusesNow();
          if (statuses.join('\n') !== lastStatuses) {
            [lastStatuses, progressAt] = [statuses.join('\n'), Date.now()];
            continue;
          }
          throw new Error(
            `stalled at ${count} model calls (${replied} replied) for ${STALL_MS / 1000} s:\n` +
              statuses.join('\n'),
          );
        }
        await sleep(100);
      }
    });

    // Every process of every server (a worker too), once every rollout is in flight: the most
    // descriptors each holds.
    const members = stackMembers(handle, await workerIndexes(handle, clients));
    const atAllHeld = sampleMembers(members);

    // What the servers burn holding every rollout with nothing to do (timers, connection checks):
    // the floor under the CPU measured during commit and restore.
    const cpuMs = {};
    ({ spent: cpuMs.idle_1s } = await cpuDuring(members, () => sleep(1000)));

    // Prepare stage by stage (each stage alone, in prepare order) under one id, resume; then the
    // checkpoint itself, prepared as a whole under a fresh id (every rollout is still held).
    const all = participants();
    const stageReplies = {};
    for (const kind of PREPARE_ORDER) {
      const members = all.members.filter((m) => m.kind === kind);
      const stage = createParticipants(members, { token: TOKEN, clients });
      const result = await time(`prepare_${kind}`, () =>
        prepare(stage, 'scale-c0', seconds(DEADLINE_S)),
      );
      if (!result.prepared)
        throw new Error(`stage ${kind} not prepared: ${JSON.stringify(result.blockers())}`);
      Object.assign(stageReplies, result.replies);
    }
    await resume(all, 'scale-c0', seconds(DEADLINE_S));
    const prepared = await time('prepare', () => prepare(all, 'scale-c1', seconds(DEADLINE_S)));
    if (!prepared.prepared) throw new Error(`not prepared: ${JSON.stringify(prepared.blockers())}`);
    const envStatus = await getControl(
      clients.control,
      `${url('env')}/ng-control/v1/checkpoint/status`,
      {
        token: TOKEN,
      },
    );
    const scope = envStatus.episodes.map(parseCaptureKey);
    const dir = join(runDir, 'checkpoints', 'scale-c1');
    let commitByProcess;
    // --profile-commit: every process (each worker too) profiled over the commit. Started before
    // it, and the commit waits until the servers are idle again: starting a profiler logs every
    // compiled function of the process (up to ~1 s of a server at 2,000 rollouts, loaded), which had
    // landed inside the timed commit. (The wait also lets idle work a prepare hurried finish
    // before the commit: profile runs only.)
    const profiledInCommit = commitProfiles ? members : [];
    if (commitProfiles) {
      toggleProfilesOf(profiledInCommit);
      await untilIdle(members);
    }
    const committed = await time('commit', async () => {
      const { value, spent, kernel, by_process } = await cpuDuring(members, () =>
        commit(all, 'scale-c1', dir, scope, seconds(DEADLINE_S)),
      );
      toggleProfilesOf(profiledInCommit);
      cpuMs.commit = spent;
      cpuMs['commit, kernel only'] = kernel;
      commitByProcess = by_process;
      return value;
    });
    // The profiles are written on the servers' event loops: before the crash kills them.
    if (commitProfiles) await sleep(3000);
    const processes = processTable(atAllHeld, commitByProcess);
    if (flags['commit-only']) {
      printCommit(timings.commit, serverTimings(handle), cpuMs, processes);
      return;
    }
    const exported = committed.env.episode_ids;
    const recordsBytes = {};
    for (const kind of ['environment', 'model', 'agent', 'resources']) {
      recordsBytes[kind] = bytesUnder(join(dir, 'gym', kind));
    }

    await time('crash', () => handle.crash());
    await Promise.all(first);
    await backend('/_ctl/release', {});
    await time('restart', () => handle.restart());
    const freshMembers = stackMembers(handle);
    const fresh = participants();
    // --profile-restore: every process (each worker too) profiled over the restore alone.
    const profiledInRestore = profiles ? freshMembers : [];
    const restored = await time('restore', async () => {
      toggleProfilesOf(profiledInRestore);
      const { value, spent, kernel } = await cpuDuring(freshMembers, () =>
        restore(fresh, 'scale-r1', dir, exported.map(parseCaptureKey), seconds(DEADLINE_S)),
      );
      toggleProfilesOf(profiledInRestore);
      cpuMs.restore = spent;
      cpuMs['restore, kernel only'] = kernel;
      return value;
    });
    await time('resume', () => resume(fresh, 'scale-r1', seconds(DEADLINE_S)));
    const callsBefore = (await backend('/_ctl/call_count')).count;
    // --profile-replacements: every process profiled while the replacements run.
    const profiledInReplacements = replacementProfiles ? freshMembers : [];
    toggleProfilesOf(profiledInReplacements);
    const replies = await time('replacements', async () => {
      const { value, spent, kernel } = await cpuDuring(freshMembers, () =>
        Promise.all(exported.map((key) => run(parseCaptureKey(key).rollout_id, 1))),
      );
      cpuMs.replacements = spent;
      cpuMs['replacements, kernel only'] = kernel;
      cpuMs['replacements, per rollout'] = Object.fromEntries(
        Object.entries(spent).map(([server, ms]) => [
          server,
          Math.round((ms / exported.length) * 100) / 100,
        ]),
      );
      return value;
    });
    toggleProfilesOf(profiledInReplacements);
    for (const member of profiledInReplacements)
      console.error(`profile ${member.pid}.cpuprofile: ${processLabel(member)}`);
    const callsAfter = (await backend('/_ctl/call_count')).count;
    const failures = new Map();
    let continued = 0;
    for (const reply of replies) {
      if (reply.status === 200 && reply.body.result?.reward === 1) continued += 1;
      else {
        const reason = JSON.stringify(reply.body.failure ?? reply.body.error ?? reply.body).slice(
          0,
          160,
        );
        failures.set(reason, (failures.get(reason) ?? 0) + 1);
      }
    }
    const exportedSet = new Set(exported.map((k) => parseCaptureKey(k).rollout_id));
    const overlap = [...finishedBefore].filter((id) => exportedSet.has(id)).length;
    const uncovered = ids.filter((id) => !finishedBefore.has(id) && !exportedSet.has(id)).length;
    // The same checkpoint's restore floor, with the stack stopped: records only, and records plus
    // the per-key capture-ledger install.
    await handle.stop({ graceMs: 2000 });
    const floors = {};
    for (const [name, ledger] of [
      ['records only', false],
      ['records + per-key ledger', true],
    ]) {
      floors[name] = await restoreFloor(join(dir, 'gym'), { ledger, scratchRoot: runDir });
    }
    const failedReasons = new Map();
    for (const reason of failedBefore.values()) {
      const key = JSON.stringify(reason).slice(0, 400);
      failedReasons.set(key, (failedReasons.get(key) ?? 0) + 1);
    }
    const serverTimingsMs = serverTimings(handle);
    const result = {
      scale: ROLLOUTS,
      policy_workers: POLICY_WORKERS,
      workers: WORKERS,
      machine: { cpus: cpus().length, memory_gib: Math.round(totalmem() / 2 ** 30) },
      finished_before: finishedBefore.size,
      failed_before: failedBefore.size,
      failed_before_reasons: [...failedReasons.entries()].sort((a, b) => b[1] - a[1]).slice(0, 5),
      exported: exported.length,
      continued,
      failed: exported.length - continued,
      finished_and_exported: overlap,
      neither_finished_nor_exported: uncovered,
      replacement_calls: callsAfter - callsBefore,
      restored: restored.env?.restored?.length ?? 0,
      timings_s: timings,
      records_bytes: recordsBytes,
      server_timings_ms: serverTimingsMs,
      commit_over_slowest_participant: commitOverSlowest(timings.commit, serverTimingsMs),
      server_cpu_ms: cpuMs,
      processes_at_all_held: processes,
      restore_floor_ms: floors,
      restore_over_floor: Object.fromEntries(
        Object.entries(floors).map(([name, floor]) => [
          name,
          (timings.restore * 1000) / floor.wall_ms,
        ]),
      ),
      model_prepare_counts: stageReplies.policy?.report?.counts ?? null,
      staging_keys_retained: committed.policy?.staging_keys?.length ?? 0,
      replacement_failures: [...failures.entries()].sort((a, b) => b[1] - a[1]).slice(0, 5),
      network: { netdev_max_backlog: netdevMaxBacklog(), ...networkCountersSince(networkBefore) },
      targets: {
        [`prepare_le_${LIMITS_S.prepare}_s`]: timings.prepare <= LIMITS_S.prepare,
        [`commit_le_${LIMITS_S.commit}_s`]: timings.commit <= LIMITS_S.commit,
        [`restore_le_${LIMITS_S.restore}_s`]: timings.restore <= LIMITS_S.restore,
        [`restore_floor_le_${LIMITS_S.restore}_s`]:
          floors['records only'].wall_ms <= LIMITS_S.restore * 1000,
        fds_le_60_pct: processes
          .filter((row) => !row.process.startsWith('inference'))
          .every((row) => row.fds_limit !== null && row.fds <= FDS_SHARE * row.fds_limit),
        every_rollout_finished_or_exported: overlap === 0 && uncovered === 0,
        every_exported_continued: continued === exported.length,
      },
    };
    console.log('\nSTAGE                  TIME (s)');
    for (const [name, t] of Object.entries(timings))
      console.log(`${name.padEnd(22)} ${t.toFixed(3)}`);
    console.log(
      `\nrollouts ${ROLLOUTS}: finished before ${finishedBefore.size}, failed before ` +
        `${failedBefore.size}, exported ${exported.length}, ` +
        `continued ${continued}, failed ${exported.length - continued}`,
    );
    console.log(`records bytes: ${JSON.stringify(recordsBytes)}`);
    console.log(
      `network during the run: ${result.network.backlog_drops} packets dropped from a full input ` +
        `backlog (net.core.netdev_max_backlog ${result.network.netdev_max_backlog}), ` +
        `${result.network.tcp_aborts_on_timeout} connections aborted on timeout`,
    );
    printCommit(timings.commit, serverTimingsMs, cpuMs, processes);
    console.log(
      '\nRESTORE FLOOR              WALL (ms)  CPU (ms)  RESTORE / FLOOR  SLOWEST PARTICIPANT',
    );
    for (const [name, floor] of Object.entries(floors)) {
      const [slowest, by] = Object.entries(floor.by_participant).sort(
        (a, b) => b[1].wall_ms - a[1].wall_ms,
      )[0];
      const steps = Object.entries(by.steps_ms)
        .map(([k, v]) => `${k} ${v}`)
        .join(', ');
      console.log(
        `${name.padEnd(26)} ${String(floor.wall_ms).padStart(9)}  ${String(floor.cpu_ms).padStart(8)}` +
          `  ${result.restore_over_floor[name].toFixed(2).padStart(15)}  ${slowest}: ${steps}`,
      );
    }
    result.forward_waits_ms = stackForwardWaits(handle);
    printForwardWaits(result.forward_waits_ms);
    console.log(`targets: ${JSON.stringify(result.targets)}`);
    mkdirSync(dirname(OUT), { recursive: true });
    writeFileSync(OUT, `${JSON.stringify(result, null, 2)}\n`);
    console.log(`wrote ${OUT}`);
    const ok =
      result.targets.every_rollout_finished_or_exported && result.targets.every_exported_continued;
    process.exitCode = ok ? 0 : 1;
  } finally {
    await handle.stop({ graceMs: 2000 }).catch(() => undefined);
    await handle.crash({ all: true }).catch(() => undefined);
    clients.close();
    if (!flags['keep-dir']) await rm(runDir, { recursive: true, force: true });
    else console.error(`run dir kept: ${runDir}`);
  }
}

await main();
