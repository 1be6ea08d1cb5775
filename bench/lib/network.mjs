/* global process */
// The host's network counters that explain lost loopback calls at scale (Linux; empty elsewhere):
// packets dropped because a core's input backlog was full (`/proc/net/softnet_stat`, column 2;
// loopback traffic queues there), and connections the kernel aborted for lack of an answer
// (`TcpExt: TCPAbortOnTimeout` in `/proc/net/netstat`: keep-alive probes or retransmissions
// given up on).
import { readFileSync } from 'node:fs';

function read(path) {
  try {
    return readFileSync(path, 'utf8');
  } catch {
    return undefined;
  }
}

/** The counters now: `{ backlog_drops, tcp_aborts_on_timeout }`, or `{}` off Linux. */
export function networkCounters() {
  if (process.platform !== 'linux') return {};
  const softnet = read('/proc/net/softnet_stat') ?? '';
  const backlogDrops = softnet
    .trim()
    .split('\n')
    .reduce((sum, line) => sum + Number.parseInt(line.trim().split(/\s+/)[1] ?? '0', 16), 0);
  const [names, values] = (read('/proc/net/netstat') ?? '')
    .split('\n')
    .filter((line) => line.startsWith('TcpExt:'))
    .map((line) => line.split(/\s+/));
  const abortsAt = names?.indexOf('TCPAbortOnTimeout') ?? -1;
  return {
    backlog_drops: backlogDrops,
    tcp_aborts_on_timeout: abortsAt > 0 ? Number(values[abortsAt]) : null,
  };
}

/** Each counter's growth from `before` to now. */
export function networkCountersSince(before) {
  const now = networkCounters();
  return Object.fromEntries(
    Object.entries(now).map(([name, value]) => [
      name,
      value === null || before[name] == null ? null : value - before[name],
    ]),
  );
}

/** `net.core.netdev_max_backlog`: how many packets a core's input backlog holds, or null. */
export function netdevMaxBacklog() {
  const text = read('/proc/sys/net/core/netdev_max_backlog');
  return text === undefined ? null : Number(text);
}
