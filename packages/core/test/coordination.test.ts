import {
  createServer as createNetServer,
  type AddressInfo,
  type Server as NetServer,
  type Socket,
} from 'node:net';
import type { Server } from 'node:http';

import { cp, mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import express from 'express';

import { ControlPlane } from '../src/control/plane.js';
import { installControlPlane } from '../src/control/routes.js';

import {
  CHECKPOINT_ROUTE_PREFIX,
  checkRestore,
  commit,
  CoordinationError,
  createParticipants,
  discover,
  forget,
  prepare,
  PrepareResult,
  renew,
  replyTimeoutMs,
  restore,
  resume,
  retire,
  type CoordinationLogger,
  type DiscoverOptions,
  type Participants,
} from '../src/coordination.js';
import { CheckpointStateError, ConfigError, DeadlineExceededError } from '../src/errors.js';
import { createHttpClients, type HttpClients } from '../src/http-client.js';
import { captureKey, episodeId, parseCaptureKey, type EpisodeId } from '../src/identity.js';
import type { JsonObject } from '../src/json.js';
import type { Logger } from '../src/logging.js';
import {
  type AdmissionRequest,
  BaseParticipant,
  type PrepareReport,
  prepareReport,
} from '../src/participant.js';
import { parseStackFile } from '../src/settings.js';
import {
  type CheckpointRecord,
  MANIFEST_FILE,
  participantDir,
  writeParticipantState,
} from '../src/store.js';

// --- fake participants: small express servers that record every control request ---------------

type Route = 'status' | 'prepare' | 'commit' | 'restore' | 'resume' | 'renew' | 'retire' | 'forget';
type Reply = { status?: number; json: unknown } | 'hang';
type Handler = (body: Record<string, unknown>) => Reply | Promise<Reply>;

interface Recorded {
  route: string;
  raw: Buffer;
  json: Record<string, unknown>;
  headers: Record<string, string | string[] | undefined>;
}

interface Fake {
  name: string;
  kind: string;
  url: string;
  requests: Recorded[];
  bodies(route: Route): Record<string, unknown>[];
}

const TOKEN = 'control-token';
/** Arrival order of every control request in the test, as `server:route`. */
let calls: string[] = [];
let cleanups: (() => Promise<void> | void)[] = [];
let clients: HttpClients;

beforeEach(() => {
  calls = [];
  clients = createHttpClients();
  cleanups = [() => clients.close()];
});

afterEach(async () => {
  for (const cleanup of cleanups.reverse()) await cleanup();
});

function prepared(restarts: string[] = []): Reply {
  return {
    json: {
      phase: 'prepared',
      report: { ready: true, blockers: [], blocker_count: 0, counts: {}, restarts },
    },
  };
}

function refuse(code: string, detail: string, status = 409): Reply {
  return { status, json: { error: { code, detail } } };
}

function defaultReply(name: string, kind: string, route: Route): Reply {
  switch (route) {
    case 'status':
      return { json: { kind, instance: name, phase: 'idle', checkpoint_id: null } };
    case 'prepare':
      return prepared();
    case 'commit':
      return { json: { phase: 'committed', manifest: {}, episode_ids: [] } };
    case 'restore':
      return { json: { phase: 'restored', source_checkpoint_id: 'c0', restored: [] } };
    case 'resume':
      return { json: { phase: 'idle', idempotent: false } };
    case 'renew':
      return { json: { lease_expires_at: 1 } };
    case 'retire':
      return { json: { retired_count: 1 } };
    case 'forget':
      return { json: { forgotten_count: 1 } };
  }
}

async function listen(app: express.Express): Promise<{ server: Server; url: string }> {
  const server: Server = await new Promise((resolve) => {
    const s = app.listen(0, '127.0.0.1', () => resolve(s));
  });
  cleanups.push(async () => {
    server.closeAllConnections();
    await new Promise((resolve) => server.close(resolve));
  });
  return { server, url: `http://127.0.0.1:${(server.address() as AddressInfo).port}` };
}

async function fake(
  name: string,
  kind: string,
  handlers: Partial<Record<Route, Handler>> = {},
  options: { controlRoutes?: boolean } = {},
): Promise<Fake> {
  const requests: Recorded[] = [];
  const app = express();
  app.use(express.raw({ type: () => true }));
  if (options.controlRoutes !== false) {
    app.all(`${CHECKPOINT_ROUTE_PREFIX}/:route`, async (req, res) => {
      const route = req.params.route as Route;
      const raw = Buffer.isBuffer(req.body) ? req.body : Buffer.alloc(0);
      const json =
        raw.length > 0 ? (JSON.parse(raw.toString('utf8')) as Record<string, unknown>) : {};
      requests.push({ route, raw, json, headers: req.headers });
      calls.push(`${name}:${route}`);
      const reply = await (handlers[route] ?? (() => defaultReply(name, kind, route)))(json);
      if (reply !== 'hang') res.status(reply.status ?? 200).json(reply.json);
    });
  }
  const { url } = await listen(app);
  return {
    name,
    kind,
    url,
    requests,
    bodies: (route) => requests.filter((r) => r.route === route).map((r) => r.json),
  };
}

function participantsOf(fakes: Fake[], logger?: CoordinationLogger): Participants {
  return createParticipants(
    fakes.map((f) => ({ server: f.name, kind: f.kind as 'environment', url: f.url })),
    { token: TOKEN, clients, logger },
  );
}

/** The four kinds, one server each. */
async function fourKinds(handlers: Partial<Record<string, Partial<Record<Route, Handler>>>> = {}) {
  return Promise.all(
    (['environment', 'model', 'agent', 'resources'] as const).map((kind) =>
      fake(kind === 'model' ? 'policy' : kind, kind, handlers[kind]),
    ),
  );
}

function soon(seconds = 30): number {
  return Date.now() / 1000 + seconds;
}

function recordingLogger(): CoordinationLogger & { messages: string[] } {
  const messages: string[] = [];
  return { messages, warn: (message, meta) => messages.push(`${message} ${JSON.stringify(meta)}`) };
}

// --- prepare ----------------------------------------------------------------------------------

describe('prepare', () => {
  test('runs the stages in prepare order: environment, model, agent, resources', async () => {
    const fakes = await fourKinds();
    const result = await prepare(participantsOf(fakes), 'c1', soon());
    expect(result.prepared).toBe(true);
    expect(calls).toEqual([
      'environment:prepare',
      'policy:prepare',
      'agent:prepare',
      'resources:prepare',
    ]);
    expect(Object.keys(result.replies).sort()).toEqual([
      'agent',
      'environment',
      'policy',
      'resources',
    ]);
  });

  test('stops at the first stage not prepared and never contacts later stages', async () => {
    const fakes = await fourKinds({
      model: {
        prepare: () => ({
          json: {
            phase: 'preparing',
            report: { ready: false, blockers: ['r7'], blocker_count: 1, counts: {}, restarts: [] },
          },
        }),
      },
    });
    const result = await prepare(participantsOf(fakes), 'c1', soon());
    expect(result.prepared).toBe(false);
    expect(calls).toEqual(['environment:prepare', 'policy:prepare']);
    expect(result.blockers()).toEqual({ policy: ['r7'] });
    expect(Object.keys(result.replies).sort()).toEqual(['environment', 'policy']);
  });

  test('a failing stage raises and later stages are never contacted', async () => {
    const fakes = await fourKinds({
      model: { prepare: () => refuse('checkpoint_conflict', 'c0 is open') },
    });
    const error = await prepare(participantsOf(fakes), 'c1', soon()).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(CoordinationError);
    expect((error as CoordinationError).failures).toEqual({
      policy: 'HTTP 409 checkpoint_conflict c0 is open',
    });
    expect(calls).toEqual(['environment:prepare', 'policy:prepare']);
  });

  test('members of one stage are contacted concurrently', async () => {
    let arrived = 0;
    let bothArrived: () => void = () => {};
    const barrier = new Promise<void>((resolve) => (bothArrived = resolve));
    const waitForOther = async (): Promise<Reply> => {
      arrived += 1;
      if (arrived === 2) bothArrived();
      const together = await Promise.race([
        barrier.then(() => true),
        new Promise<boolean>((resolve) => setTimeout(() => resolve(false), 2000)),
      ]);
      return together ? prepared() : { json: { phase: 'preparing', report: {} } };
    };
    const fakes = [
      await fake('env-a', 'environment', { prepare: waitForOther }),
      await fake('env-b', 'environment', { prepare: waitForOther }),
      await fake('policy', 'model'),
    ];
    const result = await prepare(participantsOf(fakes), 'c1', soon());
    expect(result.prepared).toBe(true);
  });

  test('later stages receive the restarts earlier stages reported, only when non-empty', async () => {
    const fakes = await fourKinds({
      model: { prepare: () => prepared(['r2-a1', 'r1']) },
      agent: { prepare: () => prepared(['r3', 'r1']) },
    });
    await prepare(participantsOf(fakes), 'c1', soon());
    const [environment, policy, agent, resources] = fakes.map((f) => f.bodies('prepare')[0]);
    expect(environment).not.toHaveProperty('restarts');
    expect(policy).not.toHaveProperty('restarts');
    expect(agent?.restarts).toEqual(['r1', 'r2-a1']);
    expect(resources?.restarts).toEqual(['r1', 'r2-a1', 'r3']);
  });

  test('no stage is sent restarts when none were reported', async () => {
    const fakes = await fourKinds();
    await prepare(participantsOf(fakes), 'c1', soon());
    for (const f of fakes)
      expect(f.bodies('prepare')[0]).toEqual({
        checkpoint_id: 'c1',
        deadline_ts: expect.any(Number),
      });
  });
});

describe('PrepareResult', () => {
  const result = new PrepareResult(true, {
    environment: { phase: 'prepared', report: { restarts: ['b-a2'] } },
    agent: { phase: 'prepared', report: { restarts: ['a', 'b-a2'] } },
    policy: { phase: 'prepared' },
  });

  test('restarts() is the union over every reply, tolerating a missing report', () => {
    expect(result.restarts()).toEqual([episodeId('a'), episodeId('b', 2)]);
  });

  test('continued() keeps the input order and leaves the restarts out', () => {
    const scope = [
      episodeId('c'),
      episodeId('b', 2),
      episodeId('a'),
      episodeId('b', 1),
      episodeId('d'),
    ];
    expect(result.continued(scope)).toEqual([episodeId('c'), episodeId('b', 1), episodeId('d')]);
  });
});

// --- commit, renew, fan-out -------------------------------------------------------------------

describe('fan-out', () => {
  test('commit sends every participant the scope, directory and id at once, with stop only when asked', async () => {
    const fakes = await fourKinds();
    const participants = participantsOf(fakes);
    const replies = await commit(
      participants,
      'c1',
      '/ckpt/1',
      [episodeId('r1'), episodeId('r2', 1)],
      soon(),
    );
    expect(Object.keys(replies).sort()).toEqual(['agent', 'environment', 'policy', 'resources']);
    for (const f of fakes) {
      expect(f.bodies('commit')).toEqual([
        {
          checkpoint_id: 'c1',
          deadline_ts: expect.any(Number),
          checkpoint_dir: '/ckpt/1',
          episode_ids: [
            { rollout_id: 'r1', attempt: 0 },
            { rollout_id: 'r2', attempt: 1 },
          ],
        },
      ]);
    }
    await commit(participants, 'c1', '/ckpt/1', [], soon(), { stop: true });
    for (const f of fakes) expect(f.bodies('commit')[1]?.stop).toBe(true);
  });

  test('every call carries the bearer token and a JSON content type', async () => {
    const fakes = await fourKinds();
    await renew(participantsOf(fakes), 'c1', soon());
    for (const f of fakes) {
      expect(f.requests[0]?.headers.authorization).toBe(`Bearer ${TOKEN}`);
      expect(f.requests[0]?.headers['content-type']).toBe('application/json');
    }
  });

  test('a fan-out encodes its body once and sends identical bytes to each participant', async () => {
    const fakes = await fourKinds();
    const participants = participantsOf(fakes);
    const stringify = JSON.stringify;
    let encodings = 0;
    JSON.stringify = ((value: unknown, ...rest: []) => {
      if ((value as { checkpoint_id?: unknown } | null)?.checkpoint_id === 'enc-1') encodings += 1;
      return stringify(value, ...rest);
    }) as typeof JSON.stringify;
    try {
      await commit(participants, 'enc-1', '/ckpt', [episodeId('r1')], soon());
    } finally {
      JSON.stringify = stringify;
    }
    expect(encodings).toBe(1);
    const [first, ...others] = fakes.map((f) => f.requests[0]?.raw as Buffer);
    for (const raw of others) expect(raw.equals(first as Buffer)).toBe(true);
  });

  test('CoordinationError names every failing server, sorted, and the stage fails as a whole', async () => {
    const fakes = [
      await fake('zeta', 'resources', {
        commit: () => refuse('export_failed', 'export of c1 failed'),
      }),
      await fake('alpha', 'agent', {
        commit: () => refuse('invalid_phase', 'commit needs prepared'),
      }),
      await fake('policy', 'model'),
    ];
    const error = await commit(participantsOf(fakes), 'c1', '/ckpt', [], soon()).catch(
      (e: unknown) => e,
    );
    expect(error).toBeInstanceOf(CoordinationError);
    expect(error).toMatchObject({
      operation: 'commit',
      failures: {
        alpha: 'HTTP 409 invalid_phase commit needs prepared',
        zeta: 'HTTP 409 export_failed export of c1 failed',
      },
      message:
        'checkpoint commit failed on 2 participant(s): alpha: HTTP 409 invalid_phase commit needs prepared; ' +
        'zeta: HTTP 409 export_failed export of c1 failed',
    });
  });

  test('the reply timeout is what is left of the deadline plus 5 seconds', () => {
    expect(replyTimeoutMs(100, 200)).toBe(5000);
    expect(replyTimeoutMs(103.5, 100)).toBe(8500);
  });

  test('a participant that never replies fails the call once the deadline and its 5 s slack pass', async () => {
    const fakes = [await fake('policy', 'model', { renew: () => 'hang' })];
    const error = await renew(participantsOf(fakes), 'c1', soon(-60)).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(CoordinationError);
    expect((error as CoordinationError).failures.policy).toMatch(/within 5000 ms$/);
  });

  test('participants listed twice are refused', () => {
    const member = { server: 'p', kind: 'model' as const, url: 'http://127.0.0.1:1' };
    expect(() => createParticipants([member, member], { token: TOKEN, clients })).toThrow(
      ConfigError,
    );
  });
});

// --- restore ----------------------------------------------------------------------------------

/** A real checkpoint of `fakes` in a temporary directory: the environment holds `held`. */
async function checkpointOf(fakes: Fake[], held: readonly EpisodeId[], id = 'c1'): Promise<string> {
  const root = await mkdtemp(join(tmpdir(), 'ckpt-coordination-'));
  cleanups.push(() => rm(root, { recursive: true, force: true }));
  for (const f of fakes) {
    const records = f.kind === 'environment' ? held.map((e) => ({ episode_id: e })) : [];
    await writeParticipantState({
      checkpointDir: root,
      kind: f.kind,
      instance: f.name,
      checkpointId: id,
      records,
    });
  }
  return root;
}

describe('restore', () => {
  const scope = [episodeId('r1'), episodeId('r2', 2)];
  let dir: string;

  test('a successful restore sends no cleanup', async () => {
    const fakes = await fourKinds();
    dir = await checkpointOf(fakes, scope);
    await restore(participantsOf(fakes), 'c2', dir, scope, soon());
    expect(calls.every((call) => call.endsWith(':restore'))).toBe(true);
  });

  test('a failed restore retires the next attempts where it was accepted, resumes, and raises the restore error', async () => {
    const fakes = await fourKinds({
      model: { restore: () => refuse('invalid_checkpoint_state', 'manifest is not JSON', 422) },
    });
    dir = await checkpointOf(fakes, scope);
    const start = Date.now() / 1000;
    const error = await restore(participantsOf(fakes), 'c2', dir, scope, start + 1).catch(
      (e: unknown) => e,
    );
    expect(error).toBeInstanceOf(CoordinationError);
    expect(error).toMatchObject({
      operation: 'restore',
      failures: { policy: 'HTTP 422 invalid_checkpoint_state manifest is not JSON' },
    });
    const cleanup = calls.filter((call) => !call.endsWith(':restore'));
    // The model refused: it installed nothing, so it is sent no retire (which would mark attempts).
    expect(cleanup.slice(0, 3)).toEqual(['environment:retire', 'agent:retire', 'resources:retire']);
    expect(cleanup.slice(3)).toEqual([
      'resources:resume',
      'agent:resume',
      'policy:resume',
      'environment:resume',
    ]);
    expect(fakes.find((f) => f.name === 'policy')?.bodies('retire')).toEqual([]);
    for (const f of fakes.filter((f) => f.name !== 'policy')) {
      const [retired] = f.bodies('retire');
      expect(retired?.episode_ids).toEqual([
        { rollout_id: 'r1', attempt: 1 },
        { rollout_id: 'r2', attempt: 3 },
      ]);
      expect(retired?.checkpoint_id).toBe('c2');
      // The cleanup gets at least 30 s even though the restore's own deadline was 1 s away.
      expect(retired?.deadline_ts as number).toBeGreaterThanOrEqual(start + 30);
    }
  });

  test('the restore error is raised, not a cleanup error, even when retire and resume fail too', async () => {
    const fakes = await fourKinds({
      environment: { retire: () => refuse('internal_error', 'retire broke', 500) },
      agent: { resume: () => refuse('deadline_exceeded', 'cleanup still running') },
      resources: { restore: () => refuse('checkpoint_error', 'cannot restore here') },
    });
    const logger = recordingLogger();
    dir = await checkpointOf(fakes, scope);
    const error = await restore(participantsOf(fakes, logger), 'c2', dir, scope, soon()).catch(
      (e: unknown) => e,
    );
    expect(error).toMatchObject({
      operation: 'restore',
      failures: { resources: 'HTTP 409 checkpoint_error cannot restore here' },
    });
    // Retire stopped at its failing first stage, yet every participant was still resumed.
    expect(calls.filter((call) => call.endsWith(':retire'))).toEqual(['environment:retire']);
    expect(calls.filter((call) => call.endsWith(':resume'))).toHaveLength(4);
    expect(logger.messages).toHaveLength(2);
    expect(logger.messages[0]).toMatch(/retir.*retire broke/);
    expect(logger.messages[1]).toMatch(/resume.*cleanup still running/);
  });
});

// --- resume -----------------------------------------------------------------------------------

describe('resume', () => {
  test('runs in reverse prepare order and collects failures while later stages still run', async () => {
    const fakes = await fourKinds({
      resources: { resume: () => refuse('deadline_exceeded', 'cleanup still running') },
      agent: { resume: () => refuse('internal_error', 'boom', 500) },
    });
    const error = await resume(participantsOf(fakes), 'c1', soon()).catch((e: unknown) => e);
    expect(calls).toEqual([
      'resources:resume',
      'agent:resume',
      'policy:resume',
      'environment:resume',
    ]);
    expect(error).toBeInstanceOf(CoordinationError);
    expect(error).toMatchObject({
      operation: 'resume',
      failures: {
        resources: 'HTTP 409 deadline_exceeded cleanup still running',
        agent: 'HTTP 500 internal_error boom',
      },
    });
  });
});

// --- retire and forget ------------------------------------------------------------------------

describe.each(['retire', 'forget'] as const)('%s', (route) => {
  const run = (participants: Participants) =>
    route === 'retire'
      ? retire(participants, 'c1', [episodeId('r1'), episodeId('r2', 1)], soon())
      : forget(participants, 'c1', ['r1', 'r2'], soon());

  test('runs callers first: environment, then agent, then model and resources together', async () => {
    const fakes = [...(await fourKinds()), await fake('env-2', 'environment')];
    await run(participantsOf(fakes));
    expect(calls.slice(0, 2).sort()).toEqual([`env-2:${route}`, `environment:${route}`]);
    expect(calls[2]).toBe(`agent:${route}`);
    expect(calls.slice(3).sort()).toEqual([`policy:${route}`, `resources:${route}`]);
  });

  test('stops at the first failing stage', async () => {
    const fakes = await fourKinds({
      agent: { [route]: () => refuse('invalid_phase', 'a checkpoint is open') },
    });
    const error = await run(participantsOf(fakes)).catch((e: unknown) => e);
    expect(error).toMatchObject({
      operation: route,
      failures: { agent: 'HTTP 409 invalid_phase a checkpoint is open' },
    });
    expect(calls).toEqual([`environment:${route}`, `agent:${route}`]);
  });

  test('sends nothing for an empty list', async () => {
    const fakes = await fourKinds();
    const participants = participantsOf(fakes);
    const replies =
      route === 'retire'
        ? await retire(participants, 'c1', [], soon())
        : await forget(participants, 'c1', [], soon());
    expect(replies).toEqual({});
    expect(calls).toEqual([]);
  });
});

test('forget sends each rollout id once, sorted', async () => {
  const fakes = await fourKinds();
  await forget(participantsOf(fakes), 'c1', ['r2', 'r10', 'r1', 'r2'], soon());
  for (const f of fakes) expect(f.bodies('forget')[0]?.rollout_ids).toEqual(['r1', 'r10', 'r2']);
});

// --- discover ---------------------------------------------------------------------------------

describe('discover', () => {
  const options = (extra: Partial<DiscoverOptions> = {}): DiscoverOptions => ({
    token: TOKEN,
    clients,
    probeTimeoutSeconds: 2,
    ...extra,
  });
  const target = (f: Fake) => ({ name: f.name, url: f.url });

  async function downUrl(): Promise<string> {
    const { server, url } = await listen(express());
    server.closeAllConnections();
    await new Promise((resolve) => server.close(resolve));
    return url;
  }

  async function silentUrl(): Promise<string> {
    const sockets: Socket[] = [];
    const server: NetServer = createNetServer((socket) => sockets.push(socket));
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    cleanups.push(async () => {
      for (const socket of sockets) socket.destroy();
      await new Promise((resolve) => server.close(resolve));
    });
    return `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  }

  test('finds the participants sorted by prepare order then name, with the bearer token', async () => {
    const fakes = [
      await fake('res-b', 'resources'),
      await fake('res-a', 'resources'),
      await fake('agent', 'agent'),
      await fake('policy', 'model'),
      await fake('env', 'environment'),
    ];
    const participants = await discover(fakes.map(target), options());
    expect(participants.members.map((m) => `${m.kind}:${m.server}`)).toEqual([
      'environment:env',
      'model:policy',
      'agent:agent',
      'resources:res-a',
      'resources:res-b',
    ]);
    expect(participants.token).toBe(TOKEN);
    for (const f of fakes) expect(f.requests[0]?.headers.authorization).toBe(`Bearer ${TOKEN}`);
  });

  test('skips a server without checkpoint routes (404)', async () => {
    const fakes = [
      await fake('policy', 'model'),
      await fake('plain', 'resources', {}, { controlRoutes: false }),
    ];
    const participants = await discover(fakes.map(target), options());
    expect(participants.members.map((m) => m.server)).toEqual(['policy']);
  });

  test('reports a server that is down, one that never replies, one of unknown kind and one that fails', async () => {
    const policy = await fake('policy', 'model');
    const oracle = await fake('oracle', 'oracle');
    const broken = await fake('broken', 'agent', {
      status: () => refuse('unauthorized', 'bad token', 401),
    });
    const targets = [
      target(policy),
      target(oracle),
      target(broken),
      { name: 'down', url: await downUrl() },
      { name: 'silent', url: await silentUrl() },
    ];
    const error = await discover(targets, options({ probeTimeoutSeconds: 0.5 })).catch(
      (e: unknown) => e,
    );
    expect(error).toBeInstanceOf(CoordinationError);
    const { failures, operation } = error as CoordinationError;
    expect(operation).toBe('discover');
    expect(Object.keys(failures).sort()).toEqual(['broken', 'down', 'oracle', 'silent']);
    expect(failures.down).toMatch(/ECONNREFUSED/);
    expect(failures.silent).toBe('no status reply within 0.5 seconds');
    expect(failures.oracle).toBe('unknown participant kind "oracle"');
    expect(failures.broken).toBe('HTTP 401 unauthorized bad token');
  });

  test('retries a dropped connection up to its tries', async () => {
    let dropped = 0;
    const app = express();
    app.get(`${CHECKPOINT_ROUTE_PREFIX}/status`, (req, res) => {
      if (dropped < 1) {
        dropped += 1;
        req.socket.destroy();
        return;
      }
      res.json({ kind: 'model', instance: 'policy', phase: 'idle' });
    });
    const { url } = await listen(app);
    await expect(discover([{ name: 'policy', url }], options({ tries: 1 }))).rejects.toThrow(
      /socket hang up/,
    );
    dropped = 0;
    const participants = await discover([{ name: 'policy', url }], options({ tries: 2 }));
    expect(participants.members.map((m) => m.server)).toEqual(['policy']);
  });

  test('a deployment without a model participant is refused', async () => {
    const fakes = [await fake('env', 'environment'), await fake('agent', 'agent')];
    const error = await discover(fakes.map(target), options()).catch((e: unknown) => e);
    expect(error).toMatchObject({
      operation: 'discover',
      failures: { deployment: 'no policy model takes part in checkpoints' },
    });
  });

  test('probes every server of a stack file except the inference backends', async () => {
    const env = await fake('env', 'environment');
    const policy = await fake('policy', 'model');
    const port = (url: string) => new URL(url).port;
    // The inference server's port is closed: probing it would fail discovery.
    const stack = parseStackFile(
      [
        'servers:',
        `  inference: { kind: inference, app: fake, port: ${port(await downUrl())} }`,
        `  policy: { kind: model, app: policy, port: ${port(policy.url)} }`,
        `  env: { kind: environment, app: single_agent_turn, port: ${port(env.url)} }`,
      ].join('\n'),
    );
    const participants = await discover(stack, options());
    expect(participants.members.map((m) => m.server)).toEqual(['env', 'policy']);
  });
});

// --- against the real control plane -----------------------------------------------------------

/** A tiny in-memory participant: episodes are running, parked, or restarts (never captured). */
class MemoryParticipant extends BaseParticipant<CheckpointRecord> {
  admissionOpen = true;
  carried: ReadonlySet<string> = new Set();
  readonly episodes = new Map<string, 'running' | 'parked' | 'restart'>();

  async closeAdmission(request: AdmissionRequest): Promise<void> {
    this.admissionOpen = false;
    this.carried = request.carriedRestarts;
  }

  async openAdmission(): Promise<void> {
    this.admissionOpen = true;
    this.carried = new Set();
  }

  #blockers(): string[] {
    return [...this.episodes]
      .filter(([key, state]) => state === 'running' && !this.carried.has(key))
      .map(([key]) => key);
  }

  ready(): boolean {
    return this.#blockers().length === 0;
  }

  readiness(): PrepareReport {
    const blockers = this.#blockers();
    const restarts = [...this.episodes].filter(([, s]) => s === 'restart').map(([key]) => key);
    return prepareReport({ blockers, blockerCount: blockers.length, restarts });
  }

  async export(scope: readonly EpisodeId[] | null): Promise<CheckpointRecord[]> {
    const keys = scope === null ? null : new Set(scope.map(captureKey));
    return [...this.episodes]
      .filter(([key, state]) => state === 'parked' && (keys === null || keys.has(key)))
      .map(([key]) => ({ episode_id: parseCaptureKey(key), step: 1 }));
  }

  validateRecord(record: JsonObject): CheckpointRecord {
    return record as unknown as CheckpointRecord;
  }

  async install(): Promise<void> {}

  restoredPending(): EpisodeId[] {
    return [];
  }

  async retire(episode: EpisodeId): Promise<void> {
    this.episodes.delete(captureKey(episode));
  }
}

const silentLogger: Logger = {
  error: () => {},
  warn: () => {},
  info: () => {},
  debug: () => {},
  child: () => silentLogger,
};

async function controlPlaneServer(participant: MemoryParticipant): Promise<string> {
  const plane = new ControlPlane(participant, { leaseGraceSeconds: 60, logger: silentLogger });
  cleanups.push(() => plane.dispose());
  const app = express();
  installControlPlane(app, plane, TOKEN, { logger: silentLogger });
  return (await listen(app)).url;
}

test('discover, prepare, commit and resume drive real control planes end to end', async () => {
  const root = await mkdtemp(join(tmpdir(), 'ckpt-coordination-'));
  cleanups.push(() => rm(root, { recursive: true, force: true }));
  // r2 restarts on the environment and is still running on the model: the model must not wait
  // for it, which only holds when prepare carries the environment's restarts to it.
  const environment = new MemoryParticipant('environment', 'env');
  environment.episodes.set('r1', 'parked').set('r2', 'restart');
  const model = new MemoryParticipant('model', 'policy');
  model.episodes.set('r1', 'parked').set('r2', 'running');
  const targets = [
    { name: 'env', url: await controlPlaneServer(environment) },
    { name: 'policy', url: await controlPlaneServer(model) },
  ];

  const participants = await discover(targets, { token: TOKEN, clients });
  expect(participants.members.map((m) => `${m.kind}:${m.server}`)).toEqual([
    'environment:env',
    'model:policy',
  ]);

  const result = await prepare(participants, 'c1', soon(10));
  expect(result.prepared).toBe(true);
  expect(environment.admissionOpen || model.admissionOpen).toBe(false);
  expect(result.restarts()).toEqual([episodeId('r2')]);
  const scope = result.continued([episodeId('r1'), episodeId('r2')]);
  expect(scope).toEqual([episodeId('r1')]);

  const committed = await commit(participants, 'c1', root, scope, soon(10));
  for (const server of ['env', 'policy']) {
    expect(committed[server]).toMatchObject({ phase: 'committed', episode_ids: ['r1'] });
  }
  for (const [kind, instance] of [
    ['environment', 'env'],
    ['model', 'policy'],
  ] as const) {
    const manifest = JSON.parse(
      await readFile(join(participantDir(root, kind, instance), MANIFEST_FILE), 'utf8'),
    ) as Record<string, unknown>;
    expect(manifest).toMatchObject({ checkpoint_id: 'c1', kind, instance, record_count: 1 });
  }

  const resumed = await resume(participants, 'c1', soon(10));
  expect(Object.values(resumed).map((reply) => reply.phase)).toEqual(['idle', 'idle']);
  expect(environment.admissionOpen && model.admissionOpen).toBe(true);
});

describe('restore against real control planes: the cross-participant checks', () => {
  /** Fresh environment and model participants behind real control planes. */
  async function freshPair(): Promise<{ participants: Participants; memory: MemoryParticipant[] }> {
    const memory = [
      new MemoryParticipant('environment', 'env'),
      new MemoryParticipant('model', 'policy'),
    ];
    const targets = await Promise.all(
      memory.map(async (m) => ({ name: m.instance, url: await controlPlaneServer(m) })),
    );
    return { participants: await discover(targets, { token: TOKEN, clients }), memory };
  }

  /** Checkpoints `id` of r1 and r2 (both held everywhere) into a new directory. */
  async function checkpoint(id: string): Promise<string> {
    const root = await mkdtemp(join(tmpdir(), `ckpt-${id}-`));
    cleanups.push(() => rm(root, { recursive: true, force: true }));
    const { participants, memory } = await freshPair();
    for (const m of memory) m.episodes.set('r1', 'parked').set('r2', 'parked');
    expect((await prepare(participants, id, soon(10))).prepared).toBe(true);
    await commit(participants, id, root, [episodeId('r1'), episodeId('r2')], soon(10));
    await resume(participants, id, soon(10));
    return root;
  }

  async function expectUntouched(participants: Participants, memory: MemoryParticipant[]) {
    for (const member of participants.members) {
      const status = await clients.control
        .get(`${member.url}${CHECKPOINT_ROUTE_PREFIX}/status`, {
          headers: { authorization: `Bearer ${TOKEN}` },
        })
        .json();
      expect(status).toMatchObject({ phase: 'idle', checkpoint_id: null, retired_rollouts: 0 });
    }
    for (const m of memory) {
      expect(m.marks.size).toBe(0);
      expect(m.admissionOpen).toBe(true);
    }
  }

  const scope = [episodeId('r1'), episodeId('r2')];

  test("a participant's directory from a later checkpoint is refused before anything is sent", async () => {
    const root = await checkpoint('c1');
    const later = await checkpoint('c2');
    const tampered = await mkdtemp(join(tmpdir(), 'ckpt-tampered-'));
    cleanups.push(() => rm(tampered, { recursive: true, force: true }));
    await cp(root, tampered, { recursive: true });
    const model = participantDir(tampered, 'model', 'policy');
    await rm(model, { recursive: true });
    await cp(participantDir(later, 'model', 'policy'), model, { recursive: true });

    const { participants, memory } = await freshPair();
    const error = await restore(participants, 'back', tampered, scope, soon()).catch((e) => e);
    expect(error).toBeInstanceOf(CheckpointStateError);
    expect(error).toMatchObject({ code: 'invalid_checkpoint_state', status: 422 });
    expect((error as Error).message).toBe(
      `${join(model, MANIFEST_FILE)} names checkpoint "c2", but ` +
        `${join(participantDir(tampered, 'environment', 'env'), MANIFEST_FILE)} names "c1": ` +
        'every participant must restore the same checkpoint',
    );
    await expectUntouched(participants, memory);
    const expected = { source: join(root, 'controller.json'), checkpointId: 'c2' };
    await expect(restore(participants, 'back', root, scope, soon(), { expected })).rejects.toThrow(
      /names checkpoint "c1", but .*controller\.json names "c2"/,
    );
    await expectUntouched(participants, memory);

    const replies = await restore(participants, 'back', root, scope, soon());
    expect(replies.env).toMatchObject({ phase: 'restored', restored: ['r1-a1', 'r2-a1'] });
  });

  test('the checks are bounded by the restore deadline: past it nothing is sent', async () => {
    const root = await checkpoint('c1');
    const { participants, memory } = await freshPair();
    const error = await restore(participants, 'back', root, scope, soon(-1)).catch((e) => e);
    expect(error).toBeInstanceOf(DeadlineExceededError);
    await expectUntouched(participants, memory);
  });

  test('a scope episode no environment holds is refused, or left out as a restart when asked', async () => {
    const root = await checkpoint('c1');
    const { participants, memory } = await freshPair();
    const wider = [...scope, episodeId('r7')];
    await expect(restore(participants, 'back', root, wider, soon())).rejects.toThrow(
      /^1 episode\(s\) in the restore scope are not held by a participant that must hold them: r7 \(not in .*\/environment\/env\/manifest\.json\);/,
    );
    await expectUntouched(participants, memory);
    const checked = await checkRestore(participants, root, wider, { allowRestart: true });
    expect(checked).toEqual({ scope, restarts: [episodeId('r7')] });
    const replies = await restore(participants, 'back', root, checked.scope, soon());
    expect(replies.env).toMatchObject({ phase: 'restored', restored: ['r1-a1', 'r2-a1'] });
  });
});
