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

/** The access-timing lines of one log whose timestamp lies in [fromMs, toMs]. */
function accessLines(logPath, fromMs, toMs) {
  const lines = [];
  for (const text of readFileSync(logPath, 'utf8').split('\n')) {
    if (!text.startsWith('{') || !text.includes('"message":"request"')) continue;
    const line = JSON.parse(text);
    const at = Date.parse(line.timestamp);
    if (line.message === 'request' && at >= fromMs && at <= toMs) lines.push(line);
  }
  return lines;
}

/**
 * Per hop (`caller → server METHOD route`): how many requests, their p50/p90/p99 in ms as the
 * callee saw them, and how many did not answer 2xx. Servers without access lines (the fake
 * backend logs none) have no hop.
 */
export function hopLatencies(handle, fromMs, toMs) {
  const hops = {};
  for (const server of handle.servers.values()) {
    const byRoute = new Map();
    for (const line of accessLines(server.logPath, fromMs, toMs)) {
      const key = `${line.method} ${line.route}`;
      if (!byRoute.has(key)) byRoute.set(key, []);
      byRoute.get(key).push(line);
    }
    for (const [route, lines] of byRoute) {
      hops[`${CALLER[server.kind] ?? '?'} → ${server.name} ${route}`] = {
        server: server.name,
        kind: server.kind,
        count: lines.length,
        not_2xx: lines.filter((l) => l.status < 200 || l.status >= 300).length,
        ms: percentiles(lines.map((l) => l.ms)),
      };
    }
  }
  return hops;
}
