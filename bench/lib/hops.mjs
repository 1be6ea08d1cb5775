// Per-hop latencies of a stack from its servers' access-timing lines (core's route lifecycle
// writes one per request at CKPT_GYM_LOG_LEVEL=debug): a hop is one route of one server, timed by
// that server (the callee) from its first handler to the response's close.
import { readFileSync } from 'node:fs';

import { percentiles } from './percentile.mjs';

/** The environment a stack's servers need for their access-timing lines. */
export const ACCESS_LOG_ENV = { CKPT_GYM_LOG_LEVEL: 'debug' };

/** Who calls a server of each kind in the single-turn stack, for the hop's name. */
const CALLER = {
  environment: 'client',
  agent: 'environment',
  model: 'agent',
  resources: 'agent/environment',
  inference: 'policy',
};

/**
 * The access-timing lines of one log for requests that started and ended in [fromMs, toMs] (a
 * line is stamped when its response closed, `ms` after the request began).
 */
function accessLines(logPath, fromMs, toMs) {
  const lines = [];
  for (const text of readFileSync(logPath, 'utf8').split('\n')) {
    if (!text.startsWith('{') || !text.includes('"message":"request"')) continue;
    const line = JSON.parse(text);
    const at = Date.parse(line.timestamp);
    if (line.message === 'request' && at - line.ms >= fromMs && at <= toMs) lines.push(line);
  }
  return lines;
}

/** The access-timing lines of the stack's servers for [fromMs, toMs], each with its server. */
export function stackAccessLines(handle, fromMs, toMs) {
  return [...handle.servers.values()].flatMap((server) =>
    accessLines(server.logPath, fromMs, toMs).map((line) => ({ ...line, server })),
  );
}

const hopKey = (line) => `${line.server.name} ${line.method} ${line.route}`;

/**
 * Per hop (`caller → server METHOD route`): how many requests, their p50/p90/p99 in ms as the
 * callee saw them, and how many did not answer 2xx. Servers without access lines (the fake
 * backend logs none) have no hop.
 */
export function hopLatencies(lines) {
  const byHop = new Map();
  for (const line of lines) {
    const key = hopKey(line);
    if (!byHop.has(key)) byHop.set(key, []);
    byHop.get(key).push(line);
  }
  const hops = {};
  for (const [key, group] of byHop) {
    const { server } = group[0];
    hops[`${CALLER[server.kind] ?? '?'} → ${key}`] = {
      server: server.name,
      kind: server.kind,
      count: group.length,
      not_2xx: group.filter((l) => l.status < 200 || l.status >= 300).length,
      ms: percentiles(group.map((l) => l.ms)),
    };
  }
  return hops;
}

/**
 * What a caller spends outside the calls it makes, per episode: `outer` (capture key → ms, the
 * caller's time for the episode) minus the callee times of `inner` hops (`server METHOD route`)
 * for the same capture key. It holds the caller's own work and the transit of each call (client
 * pool, sockets, the callee's queue before its first handler): what no callee timed.
 */
export function outsideCalls(lines, outer, inner) {
  const within = new Map();
  for (const line of lines) {
    if (line.capture_key === null || !inner.includes(hopKey(line))) continue;
    within.set(line.capture_key, (within.get(line.capture_key) ?? 0) + line.ms);
  }
  const gaps = [...outer].map(([key, ms]) => ms - (within.get(key) ?? 0));
  return { count: gaps.length, ms: percentiles(gaps) };
}

/** Capture key → ms of the lines of one hop (`server METHOD route`). */
export function hopByKey(lines, hop) {
  return new Map(lines.filter((l) => hopKey(l) === hop).map((l) => [l.capture_key, l.ms]));
}
