/**
 * Request ids over real sockets: minted when the caller sends none, accepted when sane, replaced
 * when not, echoed on the reply, written on the access line, and passed on by the got clients to
 * every server the request's work calls. An upstream failure is logged with its target, without
 * the credentials or query its URL carried. All of it with tracing off and on: with it on the id
 * rides in OpenTelemetry's context instead of a storage of its own (one async context per request).
 */
import { createServer, request as httpRequest, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';

import { type Context, context, createContextKey } from '@opentelemetry/api';

import { createHttpClients, postUpstream } from '../../src/http-client.js';
import { gymRoute, mountRoutes } from '../../src/route.js';
import { createGymApp, listen, type ListeningServer } from '../../src/server.js';
import { inOperationSpan } from '../../src/telemetry/checkpoint-spans.js';
import {
  currentRequestScope,
  REQUEST_SCOPE_KEY,
  type RequestScope,
  requestIdFor,
  withRequestScope,
} from '../../src/telemetry/request-id.js';
import { captureLogLines } from '../support/log-lines.js';
import { useInMemoryTracing } from './spans.js';

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;

const clients = createHttpClients();
const closers: (() => Promise<void>)[] = [];
afterEach(async () => {
  for (const close of closers.splice(0)) await close();
});
afterAll(() => clients.close());

/** A raw HTTP server that answers each request with the request id it received. */
async function echoServer(): Promise<{ url: string; seen: (string | undefined)[] }> {
  const seen: (string | undefined)[] = [];
  const server: Server = createServer((req, res) => {
    const id = req.headers['x-request-id'];
    seen.push(typeof id === 'string' ? id : undefined);
    res.setHeader('content-type', 'application/json');
    res.end(JSON.stringify({ id: id ?? null }));
  });
  server.listen(0, '127.0.0.1');
  await new Promise((resolve) => server.once('listening', resolve));
  closers.push(() => new Promise((resolve) => server.close(() => resolve())));
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, seen };
}

/** A gym server whose `/call` route posts its body's `target` upstream, as an agent calls a tool. */
async function gym(level = 'info') {
  const { logger, lines } = captureLogLines({ level });
  const app = createGymApp({ name: 'caller', kind: 'agent', checkpoint: undefined, logger });
  mountRoutes(app.app, [
    gymRoute({
      method: 'post',
      path: '/call',
      episode: 'optional',
      body: { limit: '1kb', parse: (body) => body as { target: string } },
      run: async ({ body, signal }) => {
        const reply = await postUpstream(clients.data, body.target, { json: {}, signal });
        return JSON.parse(reply.body) as unknown;
      },
    }),
    gymRoute({
      method: 'post',
      path: '/call-briefly',
      episode: 'none',
      body: { limit: '1kb', parse: (body) => body as { target: string; ms: number } },
      run: async ({ body, signal }) => {
        const brief = AbortSignal.any([signal, AbortSignal.timeout(body.ms)]);
        try {
          await postUpstream(clients.data, body.target, { json: {}, signal: brief });
          return { timedOut: false };
        } catch {
          return { timedOut: brief.aborted };
        }
      },
    }),
  ]);
  const server: ListeningServer = await listen(app.finish(), 0);
  closers.push(() => server.close());
  return { url: server.url, lines };
}

/** A server that reads each request and never answers it. */
async function silentServer(): Promise<string> {
  const server: Server = createServer((req) => req.resume());
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  closers.push(async () => {
    server.closeAllConnections();
    await new Promise((resolve) => server.close(resolve));
  });
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
}

function call(url: string, target: string, headers: Record<string, string> = {}) {
  return fetch(`${url}/call`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: JSON.stringify({ target }),
  });
}

describe.each(['off', 'on'])('tracing %s', (tracing) => {
  if (tracing === 'on') useInMemoryTracing();

  describe('x-request-id', () => {
    test('is minted when the caller sends none, a fresh one per request, and echoed', async () => {
      const upstream = await echoServer();
      const { url } = await gym();
      const first = (await call(url, upstream.url)).headers.get('x-request-id');
      const second = (await call(url, upstream.url)).headers.get('x-request-id');
      expect(first).toMatch(UUID);
      expect(second).toMatch(UUID);
      expect(first).not.toBe(second);
    });

    test("a sane caller's id is kept, echoed and passed on to the server the request's work calls", async () => {
      const upstream = await echoServer();
      const { url } = await gym();
      const reply = await call(url, `${upstream.url}/tool`, { 'x-request-id': 'rollout-7.call:3' });
      expect(reply.headers.get('x-request-id')).toBe('rollout-7.call:3');
      expect(await reply.json()).toEqual({ id: 'rollout-7.call:3' });
      expect(upstream.seen).toEqual(['rollout-7.call:3']);
    });

    test('is passed on when the body arrives after the headers, in a later packet', async () => {
      const upstream = await echoServer();
      const { url } = await gym();
      const { port } = new URL(url);
      const status = await new Promise<number>((resolve, reject) => {
        const req = httpRequest(
          {
            host: '127.0.0.1',
            port,
            path: '/call',
            method: 'POST',
            headers: { 'content-type': 'application/json', 'x-request-id': 'slow-body' },
          },
          (res) => {
            res.resume();
            res.on('end', () => resolve(res.statusCode ?? 0));
          },
        );
        req.on('error', reject);
        req.flushHeaders();
        setTimeout(() => req.end(JSON.stringify({ target: upstream.url })), 50);
      });
      expect(status).toBe(200);
      expect(upstream.seen).toEqual(['slow-body']);
    });

    test('a minted id is the one passed on', async () => {
      const upstream = await echoServer();
      const { url } = await gym();
      const reply = await call(url, upstream.url);
      const id = reply.headers.get('x-request-id');
      expect(id).toMatch(UUID);
      expect(upstream.seen).toEqual([id]);
    });

    test('an id too long or of other characters is replaced by a minted one', async () => {
      const upstream = await echoServer();
      const { url } = await gym();
      for (const bad of ['x'.repeat(129), 'a b', 'id;drop', '"quoted"', '']) {
        const reply = await call(url, upstream.url, { 'x-request-id': bad });
        const id = reply.headers.get('x-request-id');
        expect([bad, UUID.test(id ?? '')]).toEqual([bad, true]);
        expect(upstream.seen.at(-1)).toBe(id);
      }
      expect(requestIdFor('x'.repeat(128))).toBe('x'.repeat(128));
      expect(requestIdFor(['a', 'b'])).toMatch(UUID);
    });

    test('outside a request no id is sent', async () => {
      const upstream = await echoServer();
      await clients.data.post(upstream.url, { json: {} });
      expect(upstream.seen).toEqual([undefined]);
    });

    test('the access line carries the request id with the route template, status and capture key', async () => {
      const upstream = await echoServer();
      const { url, lines } = await gym('debug');
      await fetch(`${url}/ng-rollout/r-3/call`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', 'x-request-id': 'abc-123' },
        body: JSON.stringify({ target: upstream.url }),
      });
      const deadline = Date.now() + 30_000;
      while (!lines.some((l) => l.message === 'request') && Date.now() < deadline) {
        await new Promise((resolve) => setTimeout(resolve, 10));
      }
      expect(lines.find((l) => l.message === 'request')).toMatchObject({
        level: 'debug',
        method: 'POST',
        route: '/call',
        status: 200,
        capture_key: 'r-3',
        request_id: 'abc-123',
      });
    });
  });

  describe('upstream failures', () => {
    test('a call whose caller went away is not logged as timed out', async () => {
      const target = await silentServer();
      const { url, lines } = await gym('debug');
      const gone = fetch(`${url}/call-briefly`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ target, ms: 60_000 }),
        signal: AbortSignal.timeout(300),
      });
      await expect(gone).rejects.toThrow();
      const deadline = Date.now() + 30_000;
      while (!lines.some((l) => l.message === 'request') && Date.now() < deadline) {
        await new Promise((resolve) => setTimeout(resolve, 10));
      }
      expect(lines.find((l) => l.message === 'request')).toMatchObject({ route: '/call-briefly' });
      expect(lines.filter((l) => l.message === 'upstream call timed out')).toEqual([]);
    });

    test('a call its timeout stopped is logged with its target and where its time went', async () => {
      const target = await silentServer();
      const { url, lines } = await gym();
      const reply = await fetch(`${url}/call-briefly`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', 'x-request-id': 'slow-peer' },
        body: JSON.stringify({ target: `${target}/v1/close`, ms: 300 }),
      });
      expect(await reply.json()).toEqual({ timedOut: true });
      const logged = lines.find((l) => l.message === 'upstream call timed out');
      expect(logged).toEqual({
        level: 'warn',
        message: 'upstream call timed out',
        timestamp: expect.any(String),
        target: `${target}/v1/close`,
        request_id: 'slow-peer',
        socket_ms: expect.any(Number),
        connected_ms: expect.any(Number),
        sent_ms: expect.any(Number),
        reply_ms: null,
      });
    });

    test('are logged with their target, without the credentials or query of its URL', async () => {
      const gone = await echoServer();
      const port = new URL(gone.url).port;
      await closers.pop()?.();
      const { url, lines } = await gym();
      const target = `http://user:hunter2@127.0.0.1:${port}/v1/tool?api_key=sekrit`;
      const reply = await call(url, target, { 'x-request-id': 'failing-call' });
      const body = JSON.stringify(await reply.json());
      expect([reply.status, body]).toEqual([
        502,
        expect.stringContaining(`127.0.0.1:${port}/v1/tool`),
      ]);
      const logged = lines.find((l) => l.message === 'upstream call failed');
      expect(logged).toEqual({
        level: 'warn',
        message: 'upstream call failed',
        timestamp: expect.any(String),
        target: `http://127.0.0.1:${port}/v1/tool`,
        request_id: 'failing-call',
        error: 'ECONNREFUSED',
      });
      for (const text of [JSON.stringify(logged), body]) {
        expect(text).not.toMatch(/hunter2|sekrit|user:/);
      }
    });
  });
});

describe('one async context per request', () => {
  useInMemoryTracing();

  test("while tracing is on, the request's id rides in OpenTelemetry's context", async () => {
    const { logger } = captureLogLines();
    const app = createGymApp({ name: 'traced', kind: 'agent', checkpoint: undefined, logger });
    mountRoutes(app.app, [
      gymRoute({
        method: 'get',
        path: '/scope',
        episode: 'none',
        run: () => {
          const scope = context.active().getValue(REQUEST_SCOPE_KEY) as RequestScope | undefined;
          return { id: scope?.id ?? null };
        },
      }),
    ]);
    const server = await listen(app.finish(), 0);
    closers.push(() => server.close());
    const reply = await fetch(`${server.url}/scope`, { headers: { 'x-request-id': 'in-otel' } });
    expect(await reply.json()).toEqual({ id: 'in-otel' });
  });

  test("a request's context is one small object: no Map, no closures of its own, the API's rules for values", async () => {
    const { logger } = captureLogLines();
    const app = createGymApp({ name: 'traced', kind: 'agent', checkpoint: undefined, logger });
    const seen: Context[] = [];
    mountRoutes(app.app, [
      gymRoute({
        method: 'get',
        path: '/context',
        episode: 'none',
        run: () => {
          seen.push(context.active());
          return {};
        },
      }),
    ]);
    const server = await listen(app.finish(), 0);
    closers.push(() => server.close());
    for (const id of ['first', 'second']) {
      await fetch(`${server.url}/context`, { headers: { 'x-request-id': id } });
    }
    const [first, second] = seen as [Context, Context];
    // The API's own context holds a Map and makes its methods per context (docs in request-id.ts).
    expect(Object.values(first).some((value) => value instanceof Map)).toBe(false);
    expect(first.getValue).toBe(second.getValue);
    expect(first.setValue).toBe(second.setValue);
    const scopeOf = (ctx: Context) => (ctx.getValue(REQUEST_SCOPE_KEY) as RequestScope).id;
    expect([scopeOf(first), scopeOf(second)]).toEqual(['first', 'second']);
    const key = createContextKey('another value');
    const withValue = first.setValue(key, 42);
    expect([scopeOf(withValue), withValue.getValue(key), first.getValue(key)]).toEqual([
      'first',
      42,
      undefined,
    ]);
    expect(first.deleteValue(key)).toBe(first);
    expect(first.deleteValue(REQUEST_SCOPE_KEY).getValue(REQUEST_SCOPE_KEY)).toBeUndefined();
  });

  test("a control operation's span keeps the scope of the request it serves", async () => {
    const { logger } = captureLogLines();
    const who = { kind: 'agent', instance: 'a' };
    const seen = await withRequestScope({ id: 'control-1', logger }, () =>
      inOperationSpan('prepare', who, 'ckpt-1', {}, async () => currentRequestScope()?.id),
    );
    expect(seen).toBe('control-1');
  });
});
