/* global console */
// Where requests forwarded between a server's workers spent their time, from its log at
// CKPT_GYM_LOG_LEVEL=debug: each `forward` line (written by the worker that forwarded) matched
// with the owner's access line for the same request (same request id and route: a rollout's
// requests share one id). Legs, in ms: `connect` (the forward's connection to the owner open),
// `to_app` (from then until the owner's app saw the request: the owner accepting the connection
// and reading the head), `app` (the owner's app, by its access line), `back` (from the owner's
// reply to the forwarding worker having its head), `total` (the whole forward, as the forwarding
// worker saw it). docs/workers.md reads them.
import { readFileSync } from 'node:fs';

import { percentiles } from './percentile.mjs';

const ROLLOUT_PREFIX = /^\/ng-rollout\/[^/]+/;
const LEGS = ['connect', 'to_app', 'app', 'back', 'total'];

/** The `forward` and `request` lines of a log (others skipped unparsed). */
export function forwardAndAccessLines(logPath) {
  const lines = [];
  for (const text of readFileSync(logPath, 'utf8').split('\n')) {
    if (!text.includes('"message":"forward"') && !text.includes('"message":"request"')) continue;
    try {
      lines.push(JSON.parse(text));
    } catch {
      // A line cut short by a killed process.
    }
  }
  return lines;
}

/** p50 / p90 / p99 / max of `values`, rounded to the ms (null when empty). */
function spread(values) {
  if (values.length === 0) return null;
  const max = values.reduce((a, b) => Math.max(a, b));
  const figures = { ...percentiles(values), max };
  return Object.fromEntries(Object.entries(figures).map(([k, v]) => [k, Math.round(v)]));
}

/**
 * Per forwarded route (the path without its `/ng-rollout/<key>` prefix): how many forwards, how
 * many had no single owner's line to match (`unmatched`: only `connect` and `total` count them),
 * and each leg's spread. Empty when the log has no forward lines.
 */
export function forwardWaits(lines) {
  const owners = new Map();
  for (const line of lines) {
    if (line.message !== 'request' || !line.request_id) continue;
    const key = `${line.request_id} ${line.route}`;
    owners.set(key, owners.has(key) ? null : line);
  }
  const byRoute = new Map();
  for (const line of lines) {
    if (line.message !== 'forward') continue;
    const route = line.path.replace(ROLLOUT_PREFIX, '');
    if (!byRoute.has(route)) {
      byRoute.set(route, {
        forwards: 0,
        unmatched: 0,
        legs: Object.fromEntries(LEGS.map((l) => [l, []])),
      });
    }
    const entry = byRoute.get(route);
    entry.forwards += 1;
    entry.legs.total.push(line.ms);
    if (line.connected_ms !== null) entry.legs.connect.push(line.connected_ms);
    const owner = owners.get(`${line.request_id} ${route}`);
    if (!owner || line.connected_ms === null || line.reply_ms === null) {
      entry.unmatched += 1;
      continue;
    }
    const start = Date.parse(line.timestamp) - line.ms;
    const ownerEnd = Date.parse(owner.timestamp);
    entry.legs.to_app.push(ownerEnd - owner.ms - (start + line.connected_ms));
    entry.legs.app.push(owner.ms);
    entry.legs.back.push(start + line.reply_ms - ownerEnd);
  }
  return Object.fromEntries(
    [...byRoute].map(([route, { forwards, unmatched, legs }]) => [
      route,
      {
        forwards,
        unmatched,
        ms: Object.fromEntries(LEGS.map((leg) => [leg, spread(legs[leg])])),
      },
    ]),
  );
}

/** The table `forwardWaits` gives, one block per server whose workers forwarded. */
export function printForwardWaits(byServer) {
  for (const [server, routes] of Object.entries(byServer)) {
    for (const [route, { forwards, unmatched, ms }] of Object.entries(routes)) {
      console.log(`\nFORWARDS ${server} ${route}: ${forwards} (${unmatched} unmatched)`);
      console.log('LEG (ms)          P50      P90      P99      MAX');
      for (const leg of LEGS) {
        const s = ms[leg];
        if (s === null) continue;
        const cells = [s.p50, s.p90, s.p99, s.max].map((v) => String(v).padStart(8)).join(' ');
        console.log(`${leg.padEnd(14)} ${cells}`);
      }
    }
  }
}
