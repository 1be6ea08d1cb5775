import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { mkdtempSync, rmSync } from 'node:fs';
import {
  createServer,
  type IncomingMessage,
  request,
  type Server,
  type ServerResponse,
} from 'node:http';
import { type AddressInfo, connect, type Socket } from 'node:net';

import express, { type Express } from 'express';

import { createLogger, type Logger } from '../../src/logging.js';
import { newRoutingId, ownedName, parseOwnedName } from '../../src/workers/session-owners.js';
import { SessionRouter, workerSocketPath } from '../../src/workers/session-router.js';
import { captureLogLines } from '../support/log-lines.js';

const logger = createLogger({ server: 'router-test', kind: 'resources', level: 'error' });
const SESSION_HEADER = 'x-test-session';

interface Worker {
  readonly id: string;
  readonly router: SessionRouter;
  readonly server: Server;
  readonly port: number;
}

let dir = '';
let held = 0;
/** The connections `/socket` was served on. */
const served: Socket[] = [];
const workers: Worker[] = [];

beforeEach(() => {
  dir = mkdtempSync('/tmp/cgt-');
});
afterEach(async () => {
  for (const w of workers.splice(0)) {
    await w.router.close();
    await new Promise<void>((resolve) => {
      w.server.close(() => resolve());
      w.server.closeAllConnections();
    });
  }
  rmSync(dir, { recursive: true, force: true });
});

/** A worker whose app answers which worker served, the body it read, and an event stream. */
async function worker(log: Logger = logger, forwardIdleMs?: number): Promise<Worker> {
  const id = newRoutingId();
  const router = new SessionRouter({
    ...(forwardIdleMs === undefined ? {} : { forwardIdleMs }),
    routingId: id,
    socketDir: dir,
    sessionOf: (req) => {
      const name = req.headers[SESSION_HEADER] as string | undefined;
      return name === undefined ? undefined : parseOwnedName(name);
    },
    logger: log,
  });
  const app: Express = express();
  app.use(router.middleware());
  app.post('/echo', express.text({ type: '*/*', limit: '4mb' }), (req, res) => {
    res.setHeader('set-cookie', ['a=1', 'b=2']);
    res.status(201).json({ served_by: id, body: req.body as string });
  });
  // Drops the connection once the request has reached the app: no reply ever comes.
  app.post('/drop', (req) => req.socket.destroy());
  // Answers, keeping the connection it came on for the test to watch.
  app.post('/socket', (req, res) => {
    served.push(req.socket);
    res.json({ served_by: id });
  });
  // Never replies; counts arrivals so a test knows the request got here.
  app.post('/hold', () => {
    held += 1;
  });
  app.get('/events', (_req, res) => {
    res.writeHead(200, { 'content-type': 'text/event-stream' });
    res.write(`data: first from ${id}\n\n`);
    // The second event only once the caller saw the first: the stream is not buffered.
    res.once('release', () => res.end('data: last\n\n'));
    (globalThis as Record<string, unknown>).release = () => res.emit('release');
  });
  await router.listen(app);
  const server = createServer(app);
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const w = { id, router, server, port: (server.address() as AddressInfo).port };
  workers.push(w);
  return w;
}

function post(w: Worker, session: string | undefined, body: string, path = '/echo') {
  return new Promise<{ status: number; json: Record<string, unknown>; cookies: string[] }>(
    (resolve, reject) => {
      const headers: Record<string, string> = { 'content-type': 'text/plain' };
      if (session !== undefined) headers[SESSION_HEADER] = session;
      const req = request({ port: w.port, method: 'POST', path, headers }, (res) => {
        let text = '';
        res.setEncoding('utf8');
        res.on('data', (c: string) => (text += c));
        res.on('end', () =>
          resolve({
            status: res.statusCode!,
            json: JSON.parse(text) as Record<string, unknown>,
            cookies: res.headers['set-cookie'] ?? [],
          }),
        );
      });
      req.on('error', reject);
      req.end(body);
    },
  );
}

describe('SessionRouter', () => {
  it('the router forwards to the owner and serves its own locally', async () => {
    const [a, b] = [await worker(), await worker()];
    const big = 'x'.repeat(1 << 20);
    const forwarded = await post(a, ownedName({ id: 's1', owner: b.id }), big);
    expect(forwarded.status).toBe(201);
    expect(forwarded.cookies).toEqual(['a=1', 'b=2']);
    expect(forwarded.json.served_by).toBe(b.id);
    // Compared whole but reported short: a mismatch would print a megabyte.
    expect(forwarded.json.body === big).toBe(true);
    expect((await post(a, ownedName({ id: 's2', owner: a.id }), 'own')).json.served_by).toBe(a.id);
    expect((await post(b, ownedName({ id: 's3', owner: a.id }), 'back')).json.served_by).toBe(a.id);
    expect((await post(a, undefined, 'new')).json.served_by).toBe(a.id);
  });

  it('the forwarding worker closes its idle socket to the owner, so the owner never closes one a forward is using', async () => {
    const [a, b] = [await worker(logger, 50), await worker()];
    served.length = 0;
    expect((await post(a, ownedName({ id: 's1', owner: b.id }), '', '/socket')).json).toEqual({
      served_by: b.id,
    });
    // The owner keeps an idle connection for SERVER_KEEP_ALIVE_MS: this close is the forwarder's.
    const [socket] = served;
    if (!socket!.destroyed) await once(socket!, 'close');
    expect(socket!.destroyed).toBe(true);
  });

  it('a request for an aliased owner reaches the worker the alias names', async () => {
    const [a, b] = [await worker(), await worker()];
    const dead = newRoutingId();
    a.router.adopt({ aliases: { [dead]: b.id }, placements: { plain: b.id } });
    expect((await post(a, ownedName({ id: 's1', owner: dead }), 'x')).json.served_by).toBe(b.id);
    expect((await post(a, 'plain', 'x')).json.served_by).toBe(b.id);
  });

  it('an event stream is forwarded as it is written, not buffered to its end', async () => {
    const [a, b] = [await worker(), await worker()];
    const chunks: string[] = [];
    await new Promise<void>((resolve, reject) => {
      const req = request(
        {
          port: a.port,
          path: '/events',
          headers: { [SESSION_HEADER]: ownedName({ id: 's', owner: b.id }) },
        },
        (res) => {
          res.setEncoding('utf8');
          res.on('data', (chunk: string) => {
            chunks.push(chunk);
            if (chunks.length === 1)
              ((globalThis as Record<string, unknown>).release as () => void)();
          });
          res.on('end', () => resolve());
        },
      );
      req.on('error', reject);
      req.end();
    });
    expect(chunks.join('')).toBe(`data: first from ${b.id}\n\ndata: last\n\n`);
  });

  it('a forwarded request waits while the owner’s listen backlog is full, then reaches it', async () => {
    const a = await worker();
    const owner = newRoutingId();
    const path = workerSocketPath(dir, owner);
    // The owner: backlog 1, its event loop blocked a while, so connections pile up unaccepted.
    const script = `const s = require('node:http').createServer((req, res) => { let b = ''; req.on('data', (c) => (b += c)); req.on('end', () => res.end(JSON.stringify({ served_by: 'owner', body: b }))); });
      s.listen({ path: ${JSON.stringify(path)}, backlog: 1 }, () => process.send('listening'));
      process.on('message', () => { process.send('blocking'); Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 800); });`;
    const child = spawn(process.execPath, ['-e', script], {
      stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
    });
    try {
      await once(child, 'message');
      child.send('block');
      await once(child, 'message');
      const fillers = Array.from({ length: 4 }, () => connect(path).on('error', () => {}));
      await new Promise((resolve) => setTimeout(resolve, 50));
      const reply = await post(a, ownedName({ id: 's1', owner }), 'waited');
      expect(reply.json).toEqual({ served_by: 'owner', body: 'waited' });
      for (const filler of fillers) filler.destroy();
    } finally {
      child.kill('SIGKILL');
    }
  });

  it('an owner whose worker is gone is served here, body intact, as a new session would be', async () => {
    const a = await worker();
    const b = await worker();
    await b.router.close();
    const reply = await post(a, ownedName({ id: 's1', owner: b.id }), 'kept');
    expect(reply.json).toEqual({ served_by: a.id, body: 'kept' });
    expect(a.router.tables.gone.has(b.id)).toBe(true);
  });

  it('requests for a gone owner forwarded at once are all served here, none answered 502', async () => {
    const gone = newRoutingId(); // no worker listens on its socket
    const router = new SessionRouter({
      routingId: newRoutingId(),
      socketDir: dir,
      sessionOf: (req) => parseOwnedName(req.headers[SESSION_HEADER] as string),
      logger,
    });
    const forward = router.middleware();
    // Holds requests until all arrived, then hands them to the router in one turn: every forward
    // is still connecting when the first finds the owner gone.
    const arrived: [IncomingMessage, ServerResponse][] = [];
    const server = createServer((req, res) => {
      arrived.push([req, res]);
      if (arrived.length < 4) return;
      for (const [q, r] of arrived) {
        forward(q as never, r as never, () => r.end(JSON.stringify({ served_by: 'here' })));
      }
    });
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    try {
      const w = { port: (server.address() as AddressInfo).port } as Worker;
      const replies = await Promise.all(
        [1, 2, 3, 4].map((i) => post(w, ownedName({ id: `s${i}`, owner: gone }), 'x')),
      );
      expect(replies.map((r) => [r.status, r.json])).toEqual(
        replies.map(() => [200, { served_by: 'here' }]),
      );
    } finally {
      server.close();
      await router.close();
    }
  });

  it('a forward the owner drops after it was sent is answered 502 and logged at warn with where its time went', async () => {
    const { logger: log, lines } = captureLogLines({ level: 'info' });
    const [a, b] = [await worker(log), await worker()];
    const reply = await post(a, ownedName({ id: 's1', owner: b.id }), 'lost', '/drop?key=k');
    expect(reply.status).toBe(502);
    expect(reply.json.error).toMatchObject({ code: 'upstream_error' });
    const warned = lines.filter((l) => l.level === 'warn');
    expect(warned).toEqual([
      expect.objectContaining({
        message: 'could not forward a request to the worker that owns its session',
        owner: b.id,
        method: 'POST',
        path: '/drop',
        error: 'ECONNRESET',
        socket_ms: expect.any(Number),
        connected_ms: expect.any(Number),
        sent_ms: expect.any(Number),
        reply_ms: null,
        tries: 1,
      }),
    ]);
  });

  it('every forward ends with a forward line at the access level giving where its time went', async () => {
    const { logger: log, lines } = captureLogLines({ level: 'debug' });
    const [a, b] = [await worker(log), await worker()];
    await post(a, ownedName({ id: 's1', owner: b.id }), 'timed');
    await post(a, ownedName({ id: 's2', owner: a.id }), 'served here');
    // The line is written as the reply closes, which may be just after the caller read it.
    await new Promise((resolve) => setImmediate(resolve));
    const forwards = lines.filter((l) => l.message === 'forward');
    expect(forwards).toEqual([
      expect.objectContaining({
        owner: b.id,
        method: 'POST',
        path: '/echo',
        status: 201,
        ms: expect.any(Number),
        socket_ms: expect.any(Number),
        connected_ms: expect.any(Number),
        sent_ms: expect.any(Number),
        reply_ms: expect.any(Number),
        tries: 1,
      }),
    ]);
    expect(forwards[0]).not.toHaveProperty('aborted');
  });

  it('a forward whose caller went away is not logged as failed; its forward line says aborted', async () => {
    const { logger: log, lines } = captureLogLines({ level: 'debug' });
    const [a, b] = [await worker(log), await worker()];
    const before = held;
    const req = request({
      port: a.port,
      method: 'POST',
      path: '/hold',
      headers: { [SESSION_HEADER]: ownedName({ id: 's1', owner: b.id }) },
    });
    req.on('error', () => undefined);
    req.end('waits');
    while (held === before) await new Promise((resolve) => setTimeout(resolve, 5));
    req.destroy();
    while (!lines.some((l) => l.message === 'forward')) {
      await new Promise((resolve) => setTimeout(resolve, 5));
    }
    expect(lines.filter((l) => l.level === 'warn')).toEqual([]);
    expect(lines.find((l) => l.message === 'forward')).toMatchObject({
      owner: b.id,
      path: '/hold',
      reply_ms: null,
      aborted: true,
    });
  });
});
