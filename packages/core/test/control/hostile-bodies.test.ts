/**
 * Every control route of every participant kind, over real HTTP, against hostile bodies: whatever
 * the body, the reply is below 500 and in the standard JSON error shape. The control routes are
 * core's, mounted by `createGymApp` before any server's own middleware, and served by core's
 * `listen`, so a gym app per kind here is the stack every server puts in front of them.
 * Replay a failure with HOSTILE_BODIES_SEED=<seed>.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { Agent, request } from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import fc from 'fast-check';

import { CHECKPOINT_ROUTE_PREFIX } from '../../src/coordination.js';
import { ERROR_CATALOGUE, isErrorCode } from '../../src/errors.js';
import type { ParticipantKind } from '../../src/participant.js';
import { type GymApp, type ListeningServer, createGymApp, listen } from '../../src/server.js';
import { CONTROL_ROUTES, type ControlRoute } from '../../src/control/schemas.js';
import { type HostileBody, hostileBody } from '../support/hostile-bodies.js';
import { MemoryLogger, type TestRecord, TestParticipant } from '../support/test-participant.js';

const TOKEN = 'hostile-token';
const KINDS: readonly ParticipantKind[] = ['environment', 'model', 'agent', 'resources'];

interface Served {
  readonly kind: ParticipantKind;
  readonly gym: GymApp<TestRecord>;
  readonly listening: ListeningServer;
}

interface Reply {
  readonly status: number;
  readonly contentType: string | undefined;
  readonly text: string;
}

let root = '';
const served: Served[] = [];
const agent = new Agent({ keepAlive: true });

beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'ckpt-hostile-'));
  for (const kind of KINDS) {
    const gym = createGymApp<TestRecord>({
      name: kind,
      kind,
      checkpoint: { enabled: true, controlAuthToken: TOKEN, leaseGraceSeconds: 60 },
      participant: new TestParticipant(kind, kind),
      logger: new MemoryLogger(),
    });
    served.push({ kind, gym, listening: await listen(gym.finish(), 0) });
  }
});

afterAll(async () => {
  agent.destroy();
  for (const { gym, listening } of served.splice(0)) {
    gym.plane?.dispose();
    listening.server.closeAllConnections();
    await listening.close();
  }
  await rm(root, { recursive: true, force: true });
});

function post(url: string, body: HostileBody, authorized: boolean): Promise<Reply> {
  return new Promise((resolve, reject) => {
    const headers = {
      ...body.headers,
      ...(authorized ? { authorization: `Bearer ${TOKEN}` } : {}),
    };
    const req = request(url, { method: 'POST', agent, headers }, (res) => {
      const chunks: Buffer[] = [];
      res.on('data', (chunk: Buffer) => chunks.push(chunk));
      res.on('end', () =>
        resolve({
          status: res.statusCode ?? 0,
          contentType: res.headers['content-type'],
          text: Buffer.concat(chunks).toString('utf8'),
        }),
      );
      res.on('error', reject);
    });
    req.on('error', reject);
    req.end(body.bytes.length > 0 ? body.bytes : undefined);
  });
}

/** What is wrong with a reply: a 5xx, a body that is not JSON, or an error not in the catalogue. */
function replyProblem(reply: Reply): string | undefined {
  if (reply.status >= 500 || reply.status < 200) return `status ${reply.status}`;
  if (!reply.contentType?.startsWith('application/json'))
    return `content type ${reply.contentType}`;
  let body: unknown;
  try {
    body = JSON.parse(reply.text);
  } catch {
    return 'a body that is not JSON';
  }
  if (reply.status < 400) return undefined;
  const error = (body as { error?: { code?: unknown; detail?: unknown } } | null)?.error;
  if (!isErrorCode(error?.code) || typeof error.detail !== 'string') return 'no error shape';
  const status = ERROR_CATALOGUE[error.code].status;
  return status === reply.status ? undefined : `${error.code} is ${status}, not ${reply.status}`;
}

function validBodies(): Record<ControlRoute, () => Record<string, unknown>> {
  const deadline = (): number => Math.floor(Date.now() / 1000) + 30;
  const episodes = [{ rollout_id: 'r', attempt: 0 }];
  const base = (): Record<string, unknown> => ({ checkpoint_id: 'c1', deadline_ts: deadline() });
  return {
    prepare: () => ({ ...base(), restarts: [] }),
    renew: base,
    resume: base,
    retire: () => ({ ...base(), episode_ids: episodes }),
    forget: () => ({ ...base(), rollout_ids: ['r'] }),
    commit: () => ({ ...base(), checkpoint_dir: join(root, 'c1'), episode_ids: episodes }),
    restore: () => ({ ...base(), checkpoint_dir: join(root, 'c1'), episode_ids: episodes }),
  };
}

/** A control route (or `status`, which takes no POST) with a hostile body for its fields. */
function hostileRequest(): fc.Arbitrary<{ route: string; body: HostileBody; authorized: boolean }> {
  const valid = validBodies();
  return fc.constantFrom(...CONTROL_ROUTES, 'status').chain((route) => {
    const make = valid[route as ControlRoute] ?? valid.resume;
    const body = fc.constant(null).map(make);
    return fc.record({
      route: fc.constant(route),
      body: hostileBody(Object.keys(make()), body),
      authorized: fc.oneof({ arbitrary: fc.constant(true), weight: 19 }, fc.constant(false)),
    });
  });
}

function envSeed(): number | undefined {
  const value = process.env.HOSTILE_BODIES_SEED;
  return value === undefined || value === '' ? undefined : Number(value);
}

test('no hostile body gets a 5xx or a reply outside the JSON error shape on any control route of any server kind', async () => {
  const seed = envSeed() ?? Date.now() ^ (Math.random() * 0x7fffffff);
  try {
    await fc.assert(
      fc.asyncProperty(hostileRequest(), async ({ route, body, authorized }) => {
        const replies = await Promise.all(
          served.map(({ listening }) =>
            post(`${listening.url}${CHECKPOINT_ROUTE_PREFIX}/${route}`, body, authorized),
          ),
        );
        const problems = replies.flatMap((reply, i) => {
          const problem = replyProblem(reply);
          return problem ? [`${served[i]!.kind}: ${problem}: ${reply.text.slice(0, 200)}`] : [];
        });
        expect([route, body.label, problems]).toEqual([route, body.label, []]);
      }),
      { numRuns: 800, seed },
    );
  } catch (err) {
    throw new Error(
      `hostile bodies failed; replay with HOSTILE_BODIES_SEED=${seed}\n${String(err)}`,
      {
        cause: err,
      },
    );
  }
}, 120_000);
