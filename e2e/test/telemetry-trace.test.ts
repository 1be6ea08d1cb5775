/**
 * One checkpoint is one trace across every process: a native stack of real server processes and
 * the `ckpt-gym checkpoint` CLI export over OTLP/HTTP (JSON, the standard `OTEL_*` variables) to a
 * receiver this test runs; with two rollouts in flight, the trace holds the CLI's command span,
 * the controller's operations and prepare stages, and every participant's operation under the
 * stage or operation that called it. A rollout's calls from environment to agent, policy and
 * resources are one trace too; with the stack file's `rollout_sample_ratio: 0` no rollout's request
 * is recorded and the checkpoint's trace is still whole. Spans arrive in batches: the test polls
 * the receiver. And at
 * `CKPT_GYM_LOG_LEVEL=debug` each server writes one access line per request (data, `/metrics`,
 * control, 404) with its `x-request-id`, which a rollout carries to every server it reaches.
 */
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';

import { CLI_MAIN } from '@ckpt-gym/coordinator-cli';
import { until } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { weatherEpisode } from './support/stacks.js';

afterEach(closeAll);

type OtlpValue = { stringValue?: string; intValue?: string | number; boolValue?: boolean };
interface OtlpSpan {
  traceId: string;
  spanId: string;
  parentSpanId?: string;
  name: string;
  attributes?: { key: string; value: OtlpValue }[];
}
interface OtlpExport {
  resourceSpans?: {
    resource?: { attributes?: { key: string; value: OtlpValue }[] };
    scopeSpans?: { spans?: OtlpSpan[] }[];
  }[];
}

/** A span as received, with the service that sent it and its attributes flattened. */
interface Received {
  readonly service: string;
  readonly traceId: string;
  readonly spanId: string;
  readonly parentSpanId: string | undefined;
  readonly name: string;
  readonly attributes: Record<string, string | number | boolean | undefined>;
}

function flatten(attributes: { key: string; value: OtlpValue }[] = []) {
  return Object.fromEntries(
    attributes.map(({ key, value }) => [
      key,
      value.stringValue ??
        (value.intValue === undefined ? value.boolValue : Number(value.intValue)),
    ]),
  );
}

/** A small OTLP/HTTP JSON receiver: every span posted to /v1/traces, in arrival order. */
async function otlpReceiver(): Promise<{ url: string; spans: Received[]; server: Server }> {
  const spans: Received[] = [];
  const server = createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (chunk: Buffer) => chunks.push(chunk));
    req.on('end', () => {
      if (req.url === '/v1/traces') {
        const body = JSON.parse(Buffer.concat(chunks).toString('utf8')) as OtlpExport;
        for (const resourceSpans of body.resourceSpans ?? []) {
          const service = String(flatten(resourceSpans.resource?.attributes)['service.name']);
          for (const span of (resourceSpans.scopeSpans ?? []).flatMap((s) => s.spans ?? [])) {
            spans.push({
              service,
              traceId: span.traceId,
              spanId: span.spanId,
              parentSpanId: span.parentSpanId || undefined,
              name: span.name,
              attributes: flatten(span.attributes),
            });
          }
        }
      }
      res.writeHead(200, { 'content-type': 'application/json' }).end('{}');
    });
  });
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  const { port } = server.address() as AddressInfo;
  return { url: `http://127.0.0.1:${port}/v1/traces`, spans, server };
}

/**
 * `ckpt-gym checkpoint` against the deployment, with this test's environment: jest gives a test
 * its own `process.env`, which a child inherits only when it is passed (as the launcher does).
 */
async function checkpointCli(dep: Deployment, args: readonly string[]): Promise<number | null> {
  const child = spawn(
    process.execPath,
    [CLI_MAIN, 'checkpoint', ...args, '--config', dep.handle.configPath],
    { cwd: dep.runDir, env: process.env, stdio: ['ignore', 'inherit', 'inherit'] },
  );
  const [code] = (await once(child, 'exit')) as [number | null];
  return code;
}

/**
 * Two rollouts held at their second model call, `ckpt-gym checkpoint --id <id>` taken over them,
 * then both released and finished.
 */
async function checkpointWithRolloutsHeld(dep: Deployment, id: string): Promise<void> {
  await dep.backend('/_ctl/hold', { after_calls_per_rollout: 1 });
  const rollouts = [1, 2].map((n) => dep.post('env', '/run', weatherEpisode(`${id}-r${n}`)));
  await dep.waitForCalls(4);
  const dir = join(dep.runDir, 'checkpoints', id);
  expect(await checkpointCli(dep, ['--id', id, '--dir', dir])).toBe(0);
  await dep.backend('/_ctl/release', {});
  for (const rollout of rollouts) expect((await rollout.reply).status).toBe(200);
}

const TRACE_ENV = ['OTEL_EXPORTER_OTLP_TRACES_ENDPOINT', 'OTEL_BSP_SCHEDULE_DELAY'] as const;

/** Runs `work` with every process it starts exporting its spans to `url`, in batches of 100 ms. */
async function tracedTo<T>(url: string, work: () => Promise<T>): Promise<T> {
  const saved = TRACE_ENV.map((name) => process.env[name]);
  process.env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = url;
  process.env.OTEL_BSP_SCHEDULE_DELAY = '100';
  try {
    return await work();
  } finally {
    TRACE_ENV.forEach((name, i) => {
      if (saved[i] === undefined) delete process.env[name];
      else process.env[name] = saved[i];
    });
  }
}

/** The participants of the native stack, by kind. */
const PARTICIPANTS = {
  environment: ['env'],
  model: ['policy'],
  agent: ['simple_agent'],
  resources: ['weather'],
} as const;
const ALL = Object.values(PARTICIPANTS).flat();

scenario(
  'one checkpoint with rollouts in flight is one trace across the CLI and every participant',
  async () => {
    const receiver = await otlpReceiver();
    // Every process the deployment and its CLI start reads the variables.
    await tracedTo(receiver.url, async () => {
      const dep = await Deployment.start('native', { tokenCapture: true });
      await checkpointWithRolloutsHeld(dep, 'traced-1');

      const spans = receiver.spans;
      const find = (pred: (s: Received) => boolean) => spans.filter(pred);
      const byId = (id: string | undefined) => spans.find((s) => s.spanId === id);
      await until(
        () =>
          find((s) => s.name === 'ckpt-gym checkpoint').length === 1 &&
          find((s) => s.name === 'gym.checkpoint.resume').length === ALL.length &&
          find((s) => s.name === 'POST /run' && s.service === 'env').length === 2,
        'the CLI’s span, every participant’s resume span and both /run spans',
        60_000,
      );

      // The CLI's command is the root; everything of the checkpoint is in its trace.
      const [root, ...otherRoots] = find((s) => s.name === 'ckpt-gym checkpoint');
      expect(otherRoots).toEqual([]);
      expect(root!.service).toBe('ckpt-gym');
      expect(root!.parentSpanId).toBeUndefined();
      const inTrace = find((s) => s.traceId === root!.traceId);
      const under = (parent: Received, name: string) =>
        inTrace.filter((s) => s.parentSpanId === parent.spanId && s.name === name);

      const [coordinatePrepare] = under(root!, 'gym.checkpoint.coordinate.prepare');
      expect(coordinatePrepare?.attributes['nemo.gym.checkpoint.id']).toBe('traced-1');
      for (const [kind, servers] of Object.entries(PARTICIPANTS)) {
        const [stage] = under(coordinatePrepare!, `gym.checkpoint.coordinate.prepare.${kind}`);
        expect(stage).toBeDefined();
        const prepares = under(stage!, 'gym.checkpoint.prepare');
        expect(prepares.map((s) => s.service).sort()).toEqual([...servers].sort());
        for (const span of prepares) {
          expect(span.attributes).toMatchObject({
            'nemo.gym.checkpoint.id': 'traced-1',
            'nemo.gym.checkpoint.participant_kind': kind,
            'nemo.gym.checkpoint.instance': span.service,
          });
          expect(under(span, 'gym.checkpoint.wait_ready')).toHaveLength(1);
        }
      }

      const [coordinateCommit] = under(root!, 'gym.checkpoint.coordinate.commit');
      const commits = under(coordinateCommit!, 'gym.checkpoint.commit');
      expect(commits.map((s) => s.service).sort()).toEqual([...ALL].sort());
      const envCommit = commits.find((s) => s.service === 'env')!;
      expect(envCommit.attributes['nemo.gym.checkpoint.records']).toBe(2);
      expect(Number(envCommit.attributes['nemo.gym.checkpoint.bytes'])).toBeGreaterThan(0);
      for (const span of commits) {
        expect(under(span, 'gym.checkpoint.export')).toHaveLength(1);
        expect(under(span, 'gym.checkpoint.write')).toHaveLength(1);
      }

      const [coordinateResume] = under(root!, 'gym.checkpoint.coordinate.resume');
      const resumes = inTrace.filter(
        (s) =>
          s.name === 'gym.checkpoint.resume' &&
          byId(s.parentSpanId)?.parentSpanId === coordinateResume!.spanId,
      );
      expect(resumes.map((s) => s.service).sort()).toEqual([...ALL].sort());

      // Each rollout is one trace: its /run on the environment, and under it the agent's, the
      // policy's, the resources server's and the backend's spans; every parent arrives (their
      // processes export on their own schedules, so it is polled for).
      const runs = find((s) => s.name === 'POST /run' && s.service === 'env');
      const rolloutOf = (run: Received) => find((s) => s.traceId === run.traceId);
      await until(
        () =>
          runs.every((run) =>
            rolloutOf(run).every((s) => s === run || byId(s.parentSpanId) !== undefined),
          ),
        'the parent of every span of each rollout',
        60_000,
      );
      for (const run of runs) {
        expect(run.parentSpanId).toBeUndefined();
        const services = new Set(rolloutOf(run).map((s) => s.service));
        expect(services).toEqual(
          new Set(['env', 'simple_agent', 'policy', 'weather', 'inference']),
        );
        expect(run.traceId).not.toBe(root!.traceId);
      }
    }).finally(() => receiver.server.close());
  },
  240_000,
);

scenario(
  'with no rollout sampled, a checkpoint with rollouts in flight is still one whole trace, and no request of a rollout is recorded',
  async () => {
    const receiver = await otlpReceiver();
    await tracedTo(receiver.url, async () => {
      const dep = await Deployment.start('native', { rolloutSampleRatio: 0 });
      await checkpointWithRolloutsHeld(dep, 'unsampled-1');

      const spans = receiver.spans;
      const named = (name: string) => spans.filter((s) => s.name === name);
      await until(
        () => named('gym.checkpoint.resume').length === ALL.length,
        'every participant’s resume span',
        60_000,
      );
      // A request span would be exported within two 100 ms batches of its end: give it ten.
      await new Promise((resolve) => setTimeout(resolve, 2_000));
      const [root, ...otherRoots] = named('ckpt-gym checkpoint');
      expect(otherRoots).toEqual([]);
      const inTrace = spans.filter((s) => s.traceId === root!.traceId);
      for (const operation of ['prepare', 'commit', 'resume']) {
        const participants = inTrace.filter((s) => s.name === `gym.checkpoint.${operation}`);
        expect(participants.map((s) => s.service).sort()).toEqual([...ALL].sort());
      }
      const orphans = inTrace.filter(
        (s) => s !== root && !inTrace.some((parent) => parent.spanId === s.parentSpanId),
      );
      expect(orphans).toEqual([]);
      expect(spans.filter((s) => !s.name.includes('checkpoint')).map((s) => s.name)).toEqual([]);
    }).finally(() => receiver.server.close());
  },
  240_000,
);

/** The access lines (`CKPT_GYM_LOG_LEVEL=debug`) a server wrote to its log, as JSON. */
function accessLines(dep: Deployment, server: string): Record<string, unknown>[] {
  return readFileSync(dep.server(server).logPath, 'utf8')
    .split('\n')
    .filter((line) => line.startsWith('{'))
    .map((line) => JSON.parse(line) as Record<string, unknown>)
    .filter((line) => line.message === 'request' && line.level === 'debug');
}

scenario(
  'at debug every server writes one access line per request with its id, and one x-request-id follows a rollout to the backend and the resources server',
  async () => {
    const saved = process.env.CKPT_GYM_LOG_LEVEL;
    process.env.CKPT_GYM_LOG_LEVEL = 'debug';
    try {
      const dep = await Deployment.start('native', { tokenCapture: true });
      const rolloutId = 'e2e-rollout-request-id';
      const run = await dep.clients.data.post(`${dep.url('env')}/run`, {
        json: weatherEpisode('rid-1'),
        headers: { 'x-request-id': rolloutId },
        retry: { limit: 0 },
        throwHttpErrors: false,
      });
      expect([run.statusCode, run.headers['x-request-id']]).toEqual([200, rolloutId]);
      // environment → agent → policy → backend: every model call the rollout made carries it.
      const calls = (await dep.calls()).filter((call) => call.rollout_id === 'rid-1');
      expect(calls.length).toBeGreaterThan(0);
      expect(calls.map((call) => call.request_id)).toEqual(calls.map(() => rolloutId));

      // /metrics, a control route and an unknown path on every server: one line each, its id.
      const probes = [
        { path: '/metrics', route: '/metrics', status: 200 },
        { path: '/ng-control/v1/checkpoint/status', route: '/status', status: 200 },
        { path: '/no-such-route', route: '(unmatched)', status: 404 },
      ];
      for (const server of ALL) {
        for (const [i, probe] of probes.entries()) {
          const res = await dep.clients.data(`${dep.url(server)}${probe.path}`, {
            headers: {
              'x-request-id': `probe-${server}-${i}`,
              authorization: `Bearer ${dep.token}`,
            },
            retry: { limit: 0 },
            throwHttpErrors: false,
          });
          expect([server, probe.path, res.statusCode]).toEqual([server, probe.path, probe.status]);
        }
      }
      // Lines are written when each response closes: poll until the last probe's has landed.
      await until(
        () =>
          ALL.every((server) =>
            accessLines(dep, server).some((l) => l.request_id === `probe-${server}-2`),
          ),
        'the access line of every probe',
        30_000,
      );
      for (const server of ALL) {
        const lines = accessLines(dep, server);
        for (const [i, probe] of probes.entries()) {
          const mine = lines.filter((line) => line.request_id === `probe-${server}-${i}`);
          expect([server, mine.map((line) => [line.method, line.status])]).toEqual([
            server,
            [['GET', probe.status]],
          ]);
          expect(String(mine[0]!.route)).toContain(probe.route);
        }
        // Every server the rollout reached (the agent's resources server included) logged it.
        const rollout = lines.filter((line) => line.request_id === rolloutId);
        expect([server, rollout.length > 0]).toEqual([server, true]);
      }
    } finally {
      if (saved === undefined) delete process.env.CKPT_GYM_LOG_LEVEL;
      else process.env.CKPT_GYM_LOG_LEVEL = saved;
    }
  },
  240_000,
);
