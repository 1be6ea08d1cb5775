// Every process of a launched stack, from /proc (Linux): each server is its process group (a
// server with several workers: its primary and the workers it forked), and each process's open
// descriptors and CPU, so a benchmark can show a worker's share next to the other processes'.
import { readdirSync, readFileSync } from 'node:fs';

/** Clock ticks a second of /proc/<pid>/stat's times (USER_HZ, 100 on Linux). */
const TICKS_PER_S = 100;

/**
 * The fields of /proc/<pid>/stat after `pid (comm) `: state is [0], ppid [1], pgrp [2], minflt
 * [7], majflt [9], utime [11], stime [12].
 */
function statFields(pid) {
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
  return stat.slice(stat.lastIndexOf(') ') + 2).split(' ');
}

/** The live processes of group `pgid`, the leader first. */
export function groupPids(pgid) {
  const pids = [];
  for (const name of readdirSync('/proc')) {
    if (!/^\d+$/.test(name)) continue;
    try {
      if (Number(statFields(name)[2]) === pgid) pids.push(Number(name));
    } catch {
      // Gone meanwhile.
    }
  }
  return pids.sort((a, b) => (a === pgid ? -1 : b === pgid ? 1 : a - b));
}

/**
 * One process's CPU so far (user + system, and system alone), ms, and page faults so far (minor:
 * first touch of memory; major: read from disk): one read of its stat, cheap enough to take around
 * timed work.
 */
export function sampleCpu(pid) {
  const fields = statFields(pid);
  const [user, system] = [Number(fields[11]), Number(fields[12])];
  return {
    pid,
    ppid: Number(fields[1]),
    cpu_ms: ((user + system) * 1000) / TICKS_PER_S,
    kernel_ms: (system * 1000) / TICKS_PER_S,
    minflt: Number(fields[7]),
    majflt: Number(fields[9]),
  };
}

/** A process's soft limit of open descriptors (`/proc/<pid>/limits`), or undefined. */
export function descriptorLimit(pid = 'self') {
  const line = readFileSync(`/proc/${pid}/limits`, 'utf8')
    .split('\n')
    .find((l) => l.startsWith('Max open files'));
  const soft = Number(line?.split(/\s{2,}/)[1]);
  return Number.isSafeInteger(soft) ? soft : undefined;
}

/**
 * One process now: its CPU, its open descriptors and its resident memory (MiB). Counting the
 * descriptors lists /proc/<pid>/fd, tens of ms for a server holding 8,000 rollouts' sockets: never
 * inside timed work.
 */
export function sampleProcess(pid) {
  const rssKb = Number(/VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))?.[1]);
  return {
    ...sampleCpu(pid),
    fds: readdirSync(`/proc/${pid}/fd`).length,
    rss_mib: Number.isFinite(rssKb) ? Math.round(rssKb / 1024) : null,
  };
}

/**
 * Every process of every server of `handle` (one scan of /proc: do it outside timed work):
 * `server`, `kind`, `role` (`server` for a server of one process, else `primary` or `worker`),
 * `worker` (a worker's index, from `workerIndex(server, pid)`, as its server's status lists it)
 * and `pid`.
 */
export function stackMembers(handle, workerIndex = () => undefined) {
  const members = [];
  for (const server of handle.servers.values()) {
    let pids;
    try {
      pids = groupPids(server.pid);
    } catch {
      continue; // Not Linux.
    }
    for (const pid of pids) {
      const role = pid !== server.pid ? 'worker' : pids.length > 1 ? 'primary' : 'server';
      const worker = role === 'worker' ? (workerIndex(server.name, pid) ?? null) : undefined;
      members.push({ server: server.name, kind: server.kind, role, worker, pid });
    }
  }
  return members;
}

/**
 * Each member now, with its sample (reads only their /proc entries; `sample` is `sampleProcess` or
 * `sampleCpu`); a process gone is left out.
 */
export function sampleMembers(members, sample = sampleProcess) {
  return members.flatMap((member) => {
    try {
      return [{ ...member, ...sample(member.pid) }];
    } catch {
      return [];
    }
  });
}

/**
 * CPU (ms) of each gym server so far, its whole group (every worker): `total` (user + system) and
 * `kernel` (system only), in the shape of lib/stack.mjs's `serverCpuMs`.
 */
export function cpuByServer(samples) {
  const cpu = { total: {}, kernel: {} };
  for (const row of samples) {
    if (row.kind === 'inference') continue;
    cpu.total[row.server] = (cpu.total[row.server] ?? 0) + row.cpu_ms;
    cpu.kernel[row.server] = (cpu.kernel[row.server] ?? 0) + row.kernel_ms;
  }
  return cpu;
}

/** A process's label in a table: `policy`, `policy primary`, `policy worker 1`. */
export function processLabel(row) {
  if (row.role === 'server') return row.server;
  if (row.role === 'primary') return `${row.server} primary`;
  return `${row.server} worker ${row.worker ?? `pid ${row.pid}`}`;
}
