/**
 * A gym server's `GET /metrics`, scraped over real sockets: refusals counted by their code from the
 * one error path, each checkpoint operation and its stages observed with the records and bytes it
 * moved, the call gauges read from the participant at scrape time, HTTP requests by route
 * template, and the scrape served without the control token and above the data-plane bound.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { request } from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { StaleAttemptError } from '../../src/errors.js';
import type { PrepareReport } from '../../src/participant.js';
import { gymRoute, mountRoutes } from '../../src/route.js';
import { createGymApp, type GymApp, listen, type ListenOptions } from '../../src/server.js';
import { callStates, GymMetrics, metricsObserver } from '../../src/telemetry/metrics.js';
import { MemoryLogger, type TestRecord, TestParticipant } from '../support/test-participant.js';
import { samples, value } from './prometheus-text.js';

const TOKEN = 'metrics-token';
const CONTROL = '/ng-control/v1/checkpoint';

/** A participant whose readiness counts a test sets, as each server kind names them. */
class CountingParticipant extends TestParticipant {
  counts: Record<string, number> = {};

  override readiness(): PrepareReport {
    return { ...super.readiness(), counts: this.counts };
  }
}

function refuseAsStale(): never {
  throw new StaleAttemptError('attempt r-1 was retired');
}

interface Running {
  readonly gym: GymApp<TestRecord>;
  readonly url: string;
  readonly participant: CountingParticipant;
  hold(): Promise<void>;
  close(): Promise<void>;
}

const running: Running[] = [];
afterEach(async () => {
  for (const server of running.splice(0)) await server.close();
});

/** A checkpointing gym server with a data route that refuses on demand and one that holds. */
async function start(options: ListenOptions = {}, name = 'env'): Promise<Running> {
  const participant = new CountingParticipant('env', 'environment');
  const gym = createGymApp<TestRecord>({
    name,
    kind: 'environment',
    checkpoint: { enabled: true, controlAuthToken: TOKEN, leaseGraceSeconds: 60 },
    participant,
    logger: new MemoryLogger(),
  });
  let release = (): void => {};
  const held = new Promise<void>((resolve) => (release = resolve));
  let holding = (): void => {};
  const arrived = new Promise<void>((resolve) => (holding = resolve));
  mountRoutes(gym.app, [
    gymRoute({
      method: 'post',
      path: '/things/:id',
      episode: 'optional',
      body: { limit: '1kb', parse: (body) => ({ refuse: body.refuse === true }) },
      run: ({ body }) => (body.refuse ? refuseAsStale() : { ok: true }),
    }),
    gymRoute({
      method: 'get',
      path: '/hold',
      episode: 'none',
      run: async () => {
        holding();
        await held;
        return { ok: true };
      },
    }),
  ]);
  const server = await listen(gym.finish(), 0, '127.0.0.1', options);
  const entry: Running = {
    gym,
    url: server.url,
    participant,
    hold: () => arrived,
    async close() {
      release();
      gym.plane?.dispose();
      server.server.closeAllConnections();
      await server.close();
    },
  };
  running.push(entry);
  return entry;
}

async function scrape(url: string): Promise<string> {
  const response = await fetch(`${url}/metrics`);
  expect(response.status).toBe(200);
  expect(response.headers.get('content-type')).toMatch(/^text\/plain; version=0\.0\.4/);
  return response.text();
}

async function control(url: string, route: string, body: object) {
  const response = await fetch(`${url}${CONTROL}/${route}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', authorization: `Bearer ${TOKEN}` },
    body: JSON.stringify({ deadline_ts: Date.now() / 1000 + 30, ...body }),
  });
  return { status: response.status, body: (await response.json()) as Record<string, unknown> };
}

function postThing(url: string, path: string, body: object) {
  return fetch(`${url}${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
}

describe('refusals', () => {
  test('every typed error a route answers is counted under its code, data plane and control plane alike', async () => {
    const { url } = await start();
    expect((await postThing(url, '/things/1', { refuse: true })).status).toBe(409);
    expect((await postThing(url, '/things/2', { refuse: true })).status).toBe(409);
    expect((await fetch(`${url}/nowhere`)).status).toBe(404);
    const commit = await control(url, 'commit', {
      checkpoint_id: 'c1',
      checkpoint_dir: tmpdir(),
      episode_ids: null,
    });
    expect(commit.status).toBeGreaterThanOrEqual(400);
    const commitCode = (commit.body.error as { code: string }).code;

    const text = await scrape(url);
    const refused = (code: string) =>
      value(text, 'gym_checkpoint_events_total', { event: 'refused', code });
    expect(refused('stale_attempt')).toBe(2);
    expect(refused('not_found')).toBe(1);
    expect(refused(commitCode)).toBe(1);
    // Every series carries the server's name and kind.
    expect(samples(text, 'gym_checkpoint_events_total')[0]?.labels).toMatchObject({
      server: 'env',
      kind: 'environment',
    });
  });

  test('a data request refused as overloaded is counted; the scrape itself is served above the data bound', async () => {
    const server = await start({ maxDataConnections: 1, maxConnections: 10 });
    const busy = fetch(`${server.url}/hold`, { keepalive: false });
    await server.hold();
    const port = new URL(server.url).port;
    const get = (path: string) =>
      new Promise<{ status: number; text: string }>((resolve, reject) => {
        const req = request({ host: '127.0.0.1', port, path, agent: false }, (res) => {
          let text = '';
          res.setEncoding('utf8');
          res.on('data', (chunk: string) => (text += chunk));
          res.on('end', () => resolve({ status: res.statusCode ?? 0, text }));
        });
        req.on('error', reject);
        req.end();
      });
    expect((await get('/hold')).status).toBe(503);
    const scraped = await get('/metrics');
    expect(scraped.status).toBe(200);
    expect(
      value(scraped.text, 'gym_checkpoint_events_total', { event: 'refused', code: 'overloaded' }),
    ).toBe(1);
    await server.close();
    await busy.catch(() => undefined);
  });
});

describe('checkpoint operations', () => {
  test('each operation is observed with its outcome, each stage by name, and a commit and a restore count the records and bytes they moved', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'ckpt-metrics-'));
    try {
      const { url, participant } = await start();
      participant.start('r-1', 'parked');
      participant.start('r-2', 'parked');
      expect((await control(url, 'prepare', { checkpoint_id: 'c1' })).status).toBe(200);
      const commit = { checkpoint_id: 'c1', checkpoint_dir: dir, episode_ids: null };
      expect((await control(url, 'commit', commit)).status).toBe(200);
      expect((await control(url, 'resume', { checkpoint_id: 'c1' })).status).toBe(200);

      const text = await scrape(url);
      const count = (name: string, labels: Record<string, string>) =>
        value(text, `${name}_count`, labels);
      const operation = 'gym_checkpoint_operation_duration_ms';
      expect(count(operation, { operation: 'prepare', outcome: 'ok' })).toBe(1);
      expect(count(operation, { operation: 'commit', outcome: 'ok' })).toBe(1);
      const stage = 'gym_checkpoint_stage_duration_ms';
      for (const name of ['close_admission', 'readiness_wait']) {
        expect([name, count(stage, { operation: 'prepare', stage: name })]).toEqual([name, 1]);
      }
      for (const name of ['export', 'records_write']) {
        expect([name, count(stage, { operation: 'commit', stage: name })]).toEqual([name, 1]);
      }
      expect(value(text, 'gym_checkpoint_records_total', { operation: 'commit' })).toBe(2);
      const written = value(text, 'gym_checkpoint_bytes_total', { operation: 'commit' });
      expect(written).toBeGreaterThan(0);

      const fresh = await start({}, 'env-restored');
      const restore = await control(fresh.url, 'restore', {
        checkpoint_id: 'r1',
        checkpoint_dir: dir,
        episode_ids: [
          { rollout_id: 'r-1', attempt: 0 },
          { rollout_id: 'r-2', attempt: 0 },
        ],
      });
      expect(restore.status).toBe(200);
      const restored = await scrape(fresh.url);
      expect(value(restored, 'gym_checkpoint_records_total', { operation: 'restore' })).toBe(2);
      expect(value(restored, 'gym_checkpoint_bytes_total', { operation: 'restore' })).toBe(written);
      expect(value(restored, `${stage}_count`, { operation: 'restore', stage: 'read' })).toBe(1);
      // The restore installed two replacement attempts nobody has claimed yet.
      expect(value(restored, 'gym_restored_pending_episodes')).toBe(2);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  test('a failed operation is observed under its error code and records nothing', () => {
    const metrics = new GymMetrics({ server: 's', kind: 'agent' });
    metricsObserver(metrics).onOperation?.({
      operation: 'commit',
      checkpoint_id: 'c1',
      started_at: 0,
      outcome: 'export_failed',
      phase: 'preparing',
      stages: [{ name: 'export', ms: 12, cpu_ms: 3 }],
      ms: 12,
      cpu_ms: 3,
      episodes: 0,
    });
    return metrics.scrape().then((text) => {
      expect(
        value(text, 'gym_checkpoint_operation_duration_ms_count', {
          operation: 'commit',
          outcome: 'export_failed',
        }),
      ).toBe(1);
      expect(value(text, 'gym_checkpoint_records_total', { operation: 'commit' })).toBe(0);
    });
  });

  test("every known series starts at zero, so rate() and increase() see a server's first checkpoint", async () => {
    const text = await new GymMetrics({ server: 's', kind: 'model' }).scrape();
    const operations = 'gym_checkpoint_operation_duration_ms_count';
    for (const operation of ['prepare', 'commit', 'restore', 'retire']) {
      expect([operation, value(text, operations, { operation, outcome: 'ok' })]).toEqual([
        operation,
        0,
      ]);
    }
    const stage = { operation: 'commit', stage: 'records_write' };
    expect(value(text, 'gym_checkpoint_stage_duration_ms_count', stage)).toBe(0);
    for (const name of ['gym_checkpoint_records_total', 'gym_checkpoint_bytes_total']) {
      expect(value(text, name, { operation: 'restore' })).toBe(0);
    }
    expect(value(text, 'gym_checkpoint_events_total', { event: 'lease_expired' })).toBe(0);
  });

  test('lease expiries and the other plane failures are counted as events', async () => {
    const metrics = new GymMetrics({ server: 's', kind: 'agent' });
    const observer = metricsObserver(metrics);
    observer.onLeaseExpired?.({ checkpoint_id: 'c1', phase: 'prepared' });
    observer.onLeaseExpired?.({ checkpoint_id: 'c2', phase: 'preparing' });
    observer.onExportFailed?.({ checkpoint_id: 'c3', error: 'disk full' });
    metrics.countEvent('worker_lost');
    const text = await metrics.scrape();
    const events = (event: string) => value(text, 'gym_checkpoint_events_total', { event });
    expect([events('lease_expired'), events('export_failed'), events('worker_lost')]).toEqual([
      2, 1, 1,
    ]);
  });
});

describe('call gauges', () => {
  test("each kind's readiness counts map to one set of call states", () => {
    expect(Object.fromEntries(callStates({ inflight: 3, held: 2, cut_failures: 1 }))).toEqual({
      in_flight: 3,
      held: 2,
    });
    expect(
      Object.fromEntries(
        callStates({ sessions: 9, at_boundary: 4, seeds: 1, waiting_for_resume: 2 }),
      ),
    ).toEqual({ parked: 4, waiting: 2 });
    expect(Object.fromEntries(callStates({ episodes: 5 }))).toEqual({ in_flight: 5 });
  });

  test('are read from the participant at each scrape, and its cut failures counted as they grow', async () => {
    const { url, participant } = await start();
    participant.counts = { inflight: 3, held: 2, waiting: 1, cut_failures: 1 };
    let text = await scrape(url);
    const calls = (state: string, scraped: string) => value(scraped, 'gym_calls', { state });
    expect([calls('in_flight', text), calls('held', text), calls('waiting', text)]).toEqual([
      3, 2, 1,
    ]);
    expect(value(text, 'gym_restored_pending_episodes')).toBe(0);
    participant.counts = { inflight: 1, cut_failures: 3 };
    participant.restored.set('r-9-a1', { episode: { rollout_id: 'r-9', attempt: 1 }, payload: 0 });
    text = await scrape(url);
    expect([calls('in_flight', text), calls('held', text)]).toEqual([1, undefined]);
    expect(value(text, 'gym_restored_pending_episodes')).toBe(1);
    expect(value(text, 'gym_checkpoint_events_total', { event: 'cut_failed' })).toBe(3);
  });
});

describe('HTTP requests', () => {
  test('are counted and timed by method, route template and status, never by raw path', async () => {
    const { url } = await start();
    await postThing(url, '/ng-rollout/r-7-a2/things/42', {});
    await postThing(url, '/things/43', {});
    await postThing(url, '/things/44', { refuse: true });
    await fetch(`${url}/no/such/path`);
    await fetch(`${url}${CONTROL}/status`, { headers: { authorization: `Bearer ${TOKEN}` } });
    const text = await scrape(url);
    const requests = (labels: Record<string, string>) =>
      value(text, 'gym_http_request_duration_ms_count', labels);
    expect(requests({ method: 'POST', route: '/things/:id', status: '200' })).toBe(2);
    expect(requests({ method: 'POST', route: '/things/:id', status: '409' })).toBe(1);
    expect(requests({ method: 'GET', route: '(unmatched)', status: '404' })).toBe(1);
    expect(requests({ method: 'GET', route: `${CONTROL}/status`, status: '200' })).toBe(1);
    expect(text).not.toMatch(/things\/4[234]|no\/such|r-7-a2/);
  });
});
