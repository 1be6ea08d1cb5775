/**
 * Connection limits of `listen` under a flood of idle connections, over real loopback sockets:
 * control calls always get through, data requests above the bound get a fast JSON 503, and
 * everything works again once the flood is gone. Every flood here is bounded and closed by the
 * test.
 */
import { type ChildProcess, spawn, spawnSync } from 'node:child_process';
import { once } from 'node:events';
import { readFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { request } from 'node:http';
import { connect, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import {
  connectionLimits,
  CONTROL_CONNECTION_RESERVE,
  createGymApp,
  FILE_DESCRIPTOR_RESERVE,
  type GymApp,
  listen,
  type ListenOptions,
  type ListeningServer,
  openFilesSoftLimit,
  processConnectionLimits,
} from '../src/server.js';
import { MemoryLogger, type TestRecord, TestParticipant } from './support/test-participant.js';
import { removeTranspiled, transpileCore } from './support/transpile.js';

const TOKEN = 'flood-token';
const STATUS_PATH = '/ng-control/v1/checkpoint/status';

interface Reply {
  readonly status: number;
  readonly headers: Record<string, string | string[] | undefined>;
  readonly body: unknown;
}

/** One request on a connection of its own (no pool), resolved with the parsed JSON reply. */
function send(port: number, path: string, token?: string, body?: unknown): Promise<Reply> {
  return new Promise((resolve, reject) => {
    const headers: Record<string, string> =
      token === undefined ? {} : { authorization: `Bearer ${token}` };
    if (body !== undefined) headers['content-type'] = 'application/json';
    const method = body === undefined ? 'GET' : 'POST';
    const req = request({ host: '127.0.0.1', port, path, method, headers, agent: false }, (res) => {
      const chunks: Buffer[] = [];
      res.on('data', (chunk: Buffer) => chunks.push(chunk));
      res.on('error', reject);
      res.on('end', () => {
        const text = Buffer.concat(chunks).toString('utf8');
        resolve({ status: res.statusCode ?? 0, headers: res.headers, body: JSON.parse(text) });
      });
    });
    req.on('error', reject);
    req.end(body === undefined ? undefined : JSON.stringify(body));
  });
}

function get(port: number, path: string, token?: string): Promise<Reply> {
  return send(port, path, token);
}

/**
 * prepare, commit and resume of checkpoint `id` into a fresh directory (removed after), each on a
 * new connection; the phases.
 */
async function checkpoint(port: number, id: string): Promise<unknown[]> {
  const dir = await mkdtemp(join(tmpdir(), 'ckpt-flood-'));
  try {
    return await checkpointInto(port, id, dir);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

async function checkpointInto(port: number, id: string, dir: string): Promise<unknown[]> {
  const deadline = (): number => Date.now() / 1000 + 30;
  const control = (route: string, body: object): Promise<Reply> =>
    send(port, `/ng-control/v1/checkpoint/${route}`, TOKEN, body);
  const replies = [
    await control('prepare', { checkpoint_id: id, deadline_ts: deadline() }),
    await control('commit', {
      checkpoint_id: id,
      deadline_ts: deadline(),
      checkpoint_dir: dir,
      episode_ids: null,
      stop: false,
    }),
    await control('resume', { checkpoint_id: id, deadline_ts: deadline() }),
  ];
  return replies.map((reply) => [reply.status, (reply.body as { phase?: unknown }).phase]);
}

/** A gate a route waits on until the test opens it. */
function gate(): { wait: Promise<void>; open(): void } {
  let open = (): void => {};
  const wait = new Promise<void>((resolve) => (open = resolve));
  return { wait, open };
}

interface Stack {
  readonly gym: GymApp<TestRecord>;
  readonly running: ListeningServer;
  /** Requests `/hold` has received and not yet answered. */
  held(): number;
  release(): void;
}

const stacks: Stack[] = [];
const floods: Socket[][] = [];

/** A gym server with checkpointing on, a data route `/data` and a data route `/hold` that waits. */
async function start(options: ListenOptions): Promise<Stack> {
  const gym = createGymApp<TestRecord>({
    name: 'env',
    kind: 'environment',
    checkpoint: { enabled: true, controlAuthToken: TOKEN, leaseGraceSeconds: 60 },
    participant: new TestParticipant('environment'),
    logger: new MemoryLogger(),
  });
  const hold = gate();
  let held = 0;
  gym.app.get('/data', (_req, res) => {
    res.json({ ok: true });
  });
  gym.app.get('/hold', async (_req, res) => {
    held += 1;
    await hold.wait;
    held -= 1;
    res.json({ ok: true });
  });
  const running = await listen(gym.finish(), 0, '127.0.0.1', options);
  const stack = { gym, running, held: () => held, release: hold.open };
  stacks.push(stack);
  return stack;
}

/** Opens `count` connections that never send a byte; resolves once all are connected. */
async function flood(port: number, count: number): Promise<Socket[]> {
  const sockets: Socket[] = [];
  floods.push(sockets);
  for (let i = 0; i < count; i += 1) {
    const socket = connect(port, '127.0.0.1');
    socket.on('error', () => {}); // an evicted socket may see a reset
    sockets.push(socket);
    await once(socket, 'connect');
  }
  return sockets;
}

/** Resolves once the server holds at most `count` connections. */
async function settleAt(running: ListeningServer, count: number): Promise<number> {
  for (;;) {
    const open = await new Promise<number>((resolve, reject) =>
      running.server.getConnections((err, n) => (err ? reject(err) : resolve(n))),
    );
    if (open <= count) return open;
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

afterEach(async () => {
  for (const sockets of floods.splice(0)) for (const socket of sockets) socket.destroy();
  for (const { gym, running, release } of stacks.splice(0)) {
    release();
    gym.plane?.dispose();
    running.server.closeAllConnections();
    await running.close();
  }
});

describe('connection limits', () => {
  test('the soft open-files limit is read from /proc/<pid>/limits', () => {
    const limits = [
      'Limit                     Soft Limit           Hard Limit           Units     ',
      'Max processes             63704                63704                processes ',
      'Max open files            20000                524288               files     ',
    ].join('\n');
    expect(openFilesSoftLimit(limits)).toBe(20_000);
    expect(
      openFilesSoftLimit(
        'Max open files            unlimited            unlimited            files',
      ),
    ).toBe(Infinity);
    expect(openFilesSoftLimit('')).toBe(Infinity);
  });

  test('the bounds keep descriptors back for files and control calls, and stay above a burst of 8,000 rollouts', () => {
    expect(connectionLimits(20_000)).toEqual({
      maxConnections: 20_000 - FILE_DESCRIPTOR_RESERVE,
      maxDataConnections: 20_000 - FILE_DESCRIPTOR_RESERVE - CONTROL_CONNECTION_RESERVE,
    });
    // 8,000 rollouts in flight hold ~16,300 descriptors in one server.
    expect(connectionLimits(20_000).maxDataConnections).toBeGreaterThan(16_300);
    // A small limit keeps at most a quarter back for files, and at most a quarter of the rest for control.
    expect(connectionLimits(1_024)).toEqual({ maxConnections: 768, maxDataConnections: 640 });
    expect(connectionLimits(Infinity)).toEqual({
      maxConnections: Infinity,
      maxDataConnections: Infinity,
    });
  });

  test("a server's hard ceiling is derived from this process's real open-files limit", async () => {
    const { running } = await start({});
    const soft = openFilesSoftLimit(readFileSync('/proc/self/limits', 'utf8'));
    expect(processConnectionLimits()).toEqual(connectionLimits(soft));
    expect(running.server.maxConnections).toBe(connectionLimits(soft).maxConnections);
    expect(running.server.maxConnections).toBeLessThan(soft);
  });
});

describe('a flood of idle connections', () => {
  test('evicts the oldest idle connections at the bound: control and data calls on new connections are served', async () => {
    const { running } = await start({ maxDataConnections: 50 });
    const sockets = await flood(running.port, 200);
    expect(await settleAt(running, 50)).toBe(50);
    // The oldest 150 were closed by the server, the newest 50 kept.
    await Promise.all(
      sockets.slice(0, 150).map((socket) => socket.closed || once(socket, 'close')),
    );
    expect(sockets.map((socket) => socket.destroyed)).toEqual([
      ...Array<boolean>(150).fill(true),
      ...Array<boolean>(50).fill(false),
    ]);

    const status = await get(running.port, STATUS_PATH, TOKEN);
    expect([status.status, (status.body as { phase: unknown }).phase]).toEqual([200, 'idle']);
    expect(await get(running.port, '/data')).toMatchObject({ status: 200, body: { ok: true } });
  });

  test('with every data connection busy, a data request on a new connection is 503 overloaded; control calls and a whole checkpoint are served', async () => {
    const stack = await start({ maxDataConnections: 20, maxConnections: 60 });
    const { port } = stack.running;
    const busy = Array.from({ length: 20 }, () => get(port, '/hold'));
    while (stack.held() < 20) await new Promise((resolve) => setTimeout(resolve, 10));
    // Above the bound, each newcomer evicts an idle one of the flood: the reserve never fills.
    await flood(port, 100);
    expect(await settleAt(stack.running, 21)).toBe(21);

    const refused = await get(port, '/data');
    expect(refused).toMatchObject({
      status: 503,
      headers: { 'x-should-retry': 'true', connection: 'close' },
      body: { error: { code: 'overloaded', detail: expect.stringMatching(/data-plane bound/) } },
    });
    const status = await get(port, STATUS_PATH, TOKEN);
    expect([status.status, (status.body as { phase: unknown }).phase]).toEqual([200, 'idle']);
    // A whole checkpoint of the server goes through its control reserve.
    expect(await checkpoint(port, 'c1')).toEqual([
      [200, 'prepared'],
      [200, 'committed'],
      [200, 'idle'],
    ]);

    // Released: the busy requests finish, the flood goes, and data requests are served again.
    stack.release();
    expect((await Promise.all(busy)).map((reply) => reply.status)).toEqual(Array(20).fill(200));
    for (const socket of floods.flat()) socket.destroy();
    await settleAt(stack.running, 0);
    expect(await get(port, '/data')).toMatchObject({ status: 200, body: { ok: true } });
  });

  test('a socket that sends no headers is closed after the overload timeout while the server is at its bound, and kept when there is room', async () => {
    const full = await start({ maxDataConnections: 5, overloadIdleTimeoutMs: 200 });
    const slow = await flood(full.running.port, 5);
    for (const socket of slow) socket.write('GET /data HTTP/1.1\r\nhost: x\r\n'); // never ends
    // The sweep closes the slow sockets that are past the timeout; once that leaves room below the
    // bound, the rest keep the ordinary headers grace (the sockets connected a few ms apart, so
    // how many a pass finds stale depends on the machine's pace).
    expect(await settleAt(full.running, 4)).toBeLessThan(5);
    await Promise.race(slow.map((socket) => socket.closed || once(socket, 'close')));

    const roomy = await start({ maxDataConnections: 50, overloadIdleTimeoutMs: 200 });
    const kept = await flood(roomy.running.port, 5);
    for (const socket of kept) socket.write('GET /data HTTP/1.1\r\nhost: x\r\n');
    // Well past the timeout the server still holds them: there was room.
    await new Promise((resolve) => setTimeout(resolve, 1_000));
    expect(kept.map((socket) => socket.destroyed)).toEqual(Array(5).fill(false));
  });

  test('a burst of 500 concurrent data requests under the bound is served in full: no 408, no 503', async () => {
    const stack = await start({});
    const { port } = stack.running;
    const burst = Array.from({ length: 500 }, () => get(port, '/hold'));
    while (stack.held() < 500) await new Promise((resolve) => setTimeout(resolve, 10));
    stack.release();
    expect((await Promise.all(burst)).map((reply) => reply.status)).toEqual(Array(500).fill(200));
  });
});

describe('a flood larger than the descriptor limit of a real process', () => {
  const hasPrlimit = spawnSync('prlimit', ['--version']).status === 0;
  let core = '';
  let child: ChildProcess | undefined;

  beforeAll(async () => {
    if (hasPrlimit) core = await transpileCore();
  });
  afterAll(async () => {
    if (core) await removeTranspiled(core);
  });
  afterEach(() => {
    child?.kill('SIGKILL');
    child = undefined;
  });

  /** Starts the fixture server under an open-files limit of `limit`; resolves with its port. */
  async function startLimited(limit: number): Promise<number> {
    const fixture = join(import.meta.dirname, 'fixtures', 'flood-server.mjs');
    child = spawn(
      'prlimit',
      [
        `--nofile=${limit}:${limit}`,
        process.execPath,
        fixture,
        join(core, 'api', 'server.js'),
        TOKEN,
      ],
      { stdio: ['ignore', 'pipe', 'inherit'] },
    );
    const [line] = (await once(child.stdout!.setEncoding('utf8'), 'data')) as [string];
    return (JSON.parse(line) as { port: number }).port;
  }

  (hasPrlimit ? test : test.skip)(
    'with 400 descriptors and 600 idle connections, a control call, a data call and a checkpoint are still served',
    async () => {
      const port = await startLimited(400);
      // Bounded by the limit's own numbers: ceiling 300, data bound 225.
      expect(connectionLimits(400)).toEqual({ maxConnections: 300, maxDataConnections: 225 });
      const sockets = await flood(port, 600);
      const status = await get(port, STATUS_PATH, TOKEN);
      expect([status.status, (status.body as { phase: unknown }).phase]).toEqual([200, 'idle']);
      expect(await get(port, '/data')).toMatchObject({ status: 200, body: { ok: true } });
      expect(await checkpoint(port, 'c1')).toEqual([
        [200, 'prepared'],
        [200, 'committed'],
        [200, 'idle'],
      ]);
      // The server closed the oldest of the flood to stay at its bound.
      while (sockets.filter((socket) => !socket.destroyed).length > 225) {
        await new Promise((resolve) => setTimeout(resolve, 20));
      }
    },
  );
});
