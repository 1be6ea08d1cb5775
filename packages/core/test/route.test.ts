/**
 * The request lifecycle of `gymRoute`: a declared route's failures are JSON through the one error
 * path, the client leaving aborts the handler's signal, the prefix rule is applied, and admission
 * runs between the body and the handler with its release after the reply; each request's
 * access-timing line is written only when the server logs at `debug`.
 */
import { once } from 'node:events';
import { request as httpRequest, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';

import express from 'express';

import { InvalidRequestError, StaleAttemptError } from '../src/errors.js';
import { errorMiddleware, notFoundMiddleware } from '../src/express.js';
import { type EpisodeId, rolloutPrefixMiddleware } from '../src/identity.js';
import { type GymRoute, gymRoute, mountRoutes } from '../src/route.js';
import { createGymApp } from '../src/server.js';
import { captureLogLines } from './support/log-lines.js';

const servers: Server[] = [];

afterEach(() => {
  for (const server of servers.splice(0)) {
    server.closeAllConnections();
    server.close();
  }
});

interface Logged {
  message: string;
  meta: Record<string, unknown> | undefined;
}

/** An app as a gym server builds it: prefix middleware, the routes, the JSON 404 and errors. */
async function serveRoutes(routes: GymRoute[]): Promise<{ url: string; logged: Logged[] }> {
  const logged: Logged[] = [];
  const app = express();
  app.use(rolloutPrefixMiddleware());
  mountRoutes(app, routes);
  app.use(notFoundMiddleware());
  app.use(errorMiddleware({ error: (message, meta) => logged.push({ message, meta }) }));
  const server = app.listen(0, '127.0.0.1');
  servers.push(server);
  await once(server, 'listening');
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, logged };
}

async function post(url: string, body: string, contentType = 'application/json') {
  const response = await fetch(url, {
    method: 'POST',
    headers: { 'content-type': contentType },
    body,
  });
  return {
    status: response.status,
    retry: response.headers.get('x-should-retry'),
    body: (await response.json()) as Record<string, unknown>,
  };
}

/** Resolves once `done()` holds; rejects after a few seconds of polling (what never happens). */
function until(done: () => boolean, what: string): Promise<void> {
  return new Promise((resolve, reject) => {
    let polls = 0;
    const poll = (): void => {
      if (done()) resolve();
      else if (++polls > 400) reject(new Error(`never happened: ${what}`));
      else setTimeout(poll, 5);
    };
    poll();
  });
}

describe('errors go through one path', () => {
  test("a parser's refusal, a body that is no object, and a handler's bug are JSON; only the bug is logged", async () => {
    const { url, logged } = await serveRoutes([
      gymRoute({
        method: 'post',
        path: '/echo',
        episode: 'none',
        body: {
          limit: '1kb',
          parse: (body) => {
            if (typeof body.n !== 'number') throw new InvalidRequestError('n: must be a number');
            return { n: body.n };
          },
        },
        run: ({ body }) => {
          if (body.n < 0) throw new Error('a bug with a secret in it');
          return { n: body.n + 1 };
        },
      }),
    ]);
    expect(await post(`${url}/echo`, '{"n": 1}')).toEqual({
      status: 200,
      retry: null,
      body: { n: 2 },
    });
    expect(await post(`${url}/echo`, '{"n": "x"}')).toEqual({
      status: 422,
      retry: 'false',
      body: { error: { code: 'invalid_request', detail: 'n: must be a number' } },
    });
    expect(await post(`${url}/echo`, '[1]')).toMatchObject({
      status: 422,
      body: { error: { code: 'invalid_request', detail: 'body: must be a JSON object' } },
    });
    expect(await post(`${url}/echo`, 'n=1', 'text/plain')).toMatchObject({ status: 422 });
    expect(await post(`${url}/echo`, `{"n": 1, "pad": "${'x'.repeat(2048)}"}`)).toMatchObject({
      status: 413,
      body: { error: { code: 'payload_too_large' } },
    });
    expect(logged).toEqual([]);
    const bug = await post(`${url}/echo`, '{"n": -1}');
    expect(bug).toMatchObject({ status: 500, body: { error: { code: 'internal_error' } } });
    expect(JSON.stringify(bug.body)).not.toContain('secret');
    expect(logged.map((line) => [line.message, line.meta?.path])).toEqual([
      ['unhandled error', '/echo'],
    ]);
  });

  test('a route that allows an absent body reads it as {}', async () => {
    const { url } = await serveRoutes([
      gymRoute({
        method: 'post',
        path: '/keys',
        episode: 'none',
        body: { limit: '1kb', parse: (body) => body, absentIsEmpty: true },
        run: ({ body }) => ({ keys: Object.keys(body) }),
      }),
    ]);
    expect(await post(`${url}/keys`, 'n=1', 'text/plain')).toMatchObject({
      status: 200,
      body: { keys: [] },
    });
  });
});

describe('the rollout prefix', () => {
  const routes = (): GymRoute[] =>
    (['required', 'optional', 'none'] as const).map((rule) =>
      gymRoute({
        method: 'post',
        path: `/${rule}`,
        episode: rule,
        body: { limit: '1kb', parse: (body) => body },
        run: ({ episode }) => ({ episode: episode ?? null }),
      }),
    );

  test('required: refused without it with rollout_id_required, the episode with it', async () => {
    const { url } = await serveRoutes(routes());
    expect(await post(`${url}/required`, '{}')).toMatchObject({
      status: 400,
      body: { error: { code: 'rollout_id_required' } },
    });
    expect((await post(`${url}/ng-rollout/r1-a2/required`, '{}')).body).toEqual({
      episode: { rollout_id: 'r1', attempt: 2 } satisfies EpisodeId,
    });
  });

  test('optional: the episode when there is one; none: never', async () => {
    const { url } = await serveRoutes(routes());
    expect((await post(`${url}/optional`, '{}')).body).toEqual({ episode: null });
    expect((await post(`${url}/ng-rollout/r1/optional`, '{}')).body).toEqual({
      episode: { rollout_id: 'r1', attempt: 0 },
    });
    expect(await post(`${url}/ng-rollout/r1/none`, '{}')).toEqual({
      status: 200,
      retry: null,
      body: { episode: null },
    });
  });
});

describe('admission', () => {
  test('runs after the body, hands its ticket to the handler, and is released after the reply or a failure; a refusal is the answer', async () => {
    const events: string[] = [];
    const { url } = await serveRoutes([
      gymRoute({
        method: 'post',
        path: '/work',
        episode: 'optional',
        body: { limit: '1kb', parse: (body) => ({ fail: body.fail === true }) },
        admit: async ({ episode }) => {
          events.push('admit');
          if (episode?.rollout_id === 'retired') throw new StaleAttemptError('retired');
          return 'ticket';
        },
        release: (ticket) => events.push(`release ${ticket}`),
        run: ({ body }, ticket) => {
          events.push(`run ${ticket}`);
          if (body.fail) throw new InvalidRequestError('asked to fail');
          return { ok: true };
        },
        reply: (res, result) => {
          events.push('reply');
          res.json(result);
        },
      }),
    ]);
    expect((await post(`${url}/work`, '[]')).status).toBe(422);
    expect(events).toEqual([]);
    expect((await post(`${url}/work`, '{}')).body).toEqual({ ok: true });
    expect(events.splice(0)).toEqual(['admit', 'run ticket', 'reply', 'release ticket']);
    expect((await post(`${url}/work`, '{"fail": true}')).status).toBe(422);
    expect(events.splice(0)).toEqual(['admit', 'run ticket', 'release ticket']);
    expect(await post(`${url}/ng-rollout/retired/work`, '{}')).toMatchObject({
      status: 409,
      body: { error: { code: 'stale_attempt' } },
    });
    expect(events).toEqual(['admit']);
  });
});

describe('a client that goes away', () => {
  test("aborts the handler's signal, releases its admission, and is no server error", async () => {
    const seen: string[] = [];
    const { url, logged } = await serveRoutes([
      gymRoute({
        method: 'post',
        path: '/slow',
        episode: 'none',
        body: { limit: '1kb', parse: (body) => body },
        admit: async () => 'ticket',
        release: () => seen.push('released'),
        run: ({ signal }) =>
          new Promise((_resolve, reject) => {
            seen.push('running');
            signal.addEventListener('abort', () => {
              seen.push('aborted');
              reject(new Error('stopped'));
            });
          }),
      }),
    ]);
    const target = new URL(`${url}/slow`);
    const req = httpRequest(target, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
    });
    req.on('error', () => undefined);
    req.end('{}');
    await until(() => seen.includes('running'), 'the handler to run');
    req.destroy();
    await until(() => seen.includes('released'), 'the release');
    expect(seen).toEqual(['running', 'aborted', 'released']);
    expect(logged).toEqual([]);
  });
});

describe('the access-timing line', () => {
  /** A gym app (createGymApp) with one templated route, logging JSON lines at `level`. */
  async function serveLogged(level?: string) {
    const { logger, lines } = captureLogLines(level === undefined ? {} : { level });
    const gym = createGymApp({ name: 'timed', kind: 'resources', checkpoint: undefined, logger });
    mountRoutes(gym.app, [
      gymRoute({
        method: 'post',
        path: '/things/:id',
        episode: 'optional',
        body: { limit: '1kb', parse: (body) => body },
        run: ({ body }) => {
          if (body.refuse === true) throw new InvalidRequestError('refused');
          return { ok: true };
        },
      }),
    ]);
    const server = gym.finish().listen(0, '127.0.0.1');
    servers.push(server);
    await once(server, 'listening');
    const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
    return { url, lines, logger };
  }

  test('names the method, the declared route (not the URL), the status, the duration and the capture key', async () => {
    const { url, lines } = await serveLogged('debug');
    expect((await post(`${url}/ng-rollout/r-7-a2/things/42`, '{}')).status).toBe(200);
    expect((await post(`${url}/things/43`, '{"refuse":true}')).status).toBe(422);
    await until(() => lines.length >= 2, 'two access lines');
    const [first, second] = lines;
    expect(first).toMatchObject({
      level: 'debug',
      message: 'request',
      method: 'POST',
      route: '/things/:id',
      status: 200,
      capture_key: 'r-7-a2',
    });
    expect(typeof first?.ms).toBe('number');
    expect(first?.ms as number).toBeGreaterThanOrEqual(0);
    expect(first).not.toHaveProperty('aborted');
    expect(second).toMatchObject({ route: '/things/:id', status: 422, capture_key: null });
  });

  test('is not written at the default level, and the reply is the same', async () => {
    const { url, lines, logger } = await serveLogged();
    const reply = await post(`${url}/ng-rollout/r-7/things/42`, '{}');
    expect(reply).toEqual({ status: 200, retry: null, body: { ok: true } });
    for (let i = 0; i < 10; i++) await new Promise(setImmediate);
    // A line logged after the request arrives in order: had the access line been written, it
    // would be before this one.
    logger.info('after the request');
    await until(() => lines.length >= 1, 'the info line');
    expect(lines.map((line) => line.message)).toEqual(['after the request']);
  });
});
