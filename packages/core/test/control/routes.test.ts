import { once } from 'node:events';
import type { Server } from 'node:http';
import { type AddressInfo, connect } from 'node:net';

import { jest } from '@jest/globals';
import express from 'express';
import fc from 'fast-check';

import { MAX_DEADLINE_AHEAD_SECONDS } from '../../src/control/deadline.js';
import { controlRouter, installControlPlane } from '../../src/control/routes.js';
import {
  CONTROL_ROUTES,
  CONTROL_VALIDATORS,
  type ControlRoute,
} from '../../src/control/schemas.js';
import { errorMiddleware, notFoundMiddleware } from '../../src/express.js';
import { type Harness, harness, settle, until, useHarness } from './harness.js';

useHarness();

const TOKEN = 'secret-token';
const servers: Server[] = [];

afterEach(async () => {
  for (const server of servers.splice(0)) {
    server.closeAllConnections();
    server.close();
  }
});

async function serve(h: Harness, bodyLimit?: string): Promise<string> {
  const app = express();
  installControlPlane(app, h.plane, TOKEN, bodyLimit === undefined ? {} : { bodyLimit });
  app.use(notFoundMiddleware());
  app.use(errorMiddleware());
  const server = app.listen(0, '127.0.0.1');
  servers.push(server);
  await once(server, 'listening');
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}/ng-control/v1/checkpoint`;
}

async function post(
  base: string,
  route: string,
  body: unknown,
  init: { token?: string | null; raw?: string; signal?: AbortSignal } = {},
): Promise<{ status: number; body: Record<string, unknown> }> {
  const headers: Record<string, string> = { 'content-type': 'application/json' };
  const token = init.token === undefined ? `Bearer ${TOKEN}` : init.token;
  if (token !== null) headers.authorization = token;
  const response = await fetch(`${base}/${route}`, {
    method: 'POST',
    headers,
    body: init.raw ?? JSON.stringify(body),
    signal: init.signal,
  });
  return { status: response.status, body: (await response.json()) as Record<string, unknown> };
}

describe('control routes', () => {
  test('status requires exactly `Bearer <token>`', async () => {
    const h = harness();
    const base = await serve(h);
    for (const authorization of [
      null,
      `bearer ${TOKEN}`,
      `Bearer  ${TOKEN}`,
      `Bearer${TOKEN}`,
      'Bearer x',
      `Bearer ${TOKEN}x`,
      TOKEN,
    ]) {
      const response = await fetch(`${base}/status`, {
        headers: authorization === null ? {} : { authorization },
      });
      expect([authorization, response.status]).toEqual([authorization, 401]);
      expect(await response.json()).toEqual({
        error: {
          code: 'unauthorized',
          detail: 'missing or invalid checkpoint control bearer token',
        },
      });
    }
    const ok = await fetch(`${base}/status`, { headers: { authorization: `Bearer ${TOKEN}` } });
    expect(ok.status).toBe(200);
    expect(await ok.json()).toMatchObject({ kind: 'environment', instance: 'test', phase: 'idle' });
  });

  test('status requires exactly one Authorization header: a repeated one is 401 whichever comes first', async () => {
    const h = harness();
    const base = new URL(await serve(h));
    // fetch joins repeated headers itself: the request is written on a socket as it is meant.
    const statusWith = async (authorizations: string[]): Promise<string> => {
      const socket = connect(Number(base.port), base.hostname);
      await once(socket, 'connect');
      const lines = authorizations.map((value) => `Authorization: ${value}\r\n`).join('');
      socket.end(
        `GET ${base.pathname}/status HTTP/1.1\r\nHost: x\r\n${lines}Connection: close\r\n\r\n`,
      );
      let reply = '';
      for await (const chunk of socket) reply += String(chunk);
      return reply.split('\r\n')[0]!;
    };
    const good = `Bearer ${TOKEN}`;
    expect(await statusWith([good])).toBe('HTTP/1.1 200 OK');
    for (const headers of [
      [good, good],
      [good, 'Bearer wrong'],
      ['Bearer wrong', good],
    ]) {
      expect([headers, await statusWith(headers)]).toEqual([headers, 'HTTP/1.1 401 Unauthorized']);
    }
  });

  test('a control token with whitespace at either end (never sendable exactly) is a config error', () => {
    const h = harness();
    for (const token of [` ${TOKEN}`, `${TOKEN} `, `${TOKEN}\t`]) {
      expect(() => controlRouter(h.plane, { token })).toThrow(
        expect.objectContaining({ code: 'invalid_config' }),
      );
    }
  });

  test('auth is checked before the body', async () => {
    const h = harness();
    const base = await serve(h, '1kb');
    expect((await post(base, 'prepare', null, { token: null, raw: '{not json' })).status).toBe(401);
    expect((await post(base, 'commit', { nonsense: true }, { token: 'Bearer wrong' })).status).toBe(
      401,
    );
    const tooLarge = JSON.stringify({ checkpoint_id: 'c1', deadline_ts: 1, pad: 'x'.repeat(4096) });
    expect((await post(base, 'prepare', null, { token: null, raw: tooLarge })).status).toBe(401);
    // The same body with the token is read, and refused for its size.
    expect((await post(base, 'prepare', null, { raw: tooLarge })).status).toBe(413);
  });

  test('a control route validates its request once', async () => {
    const h = harness();
    const base = await serve(h);
    const spy = jest.spyOn(CONTROL_VALIDATORS, 'commit');
    try {
      h.participant.start('r', 'parked');
      await post(base, 'prepare', { checkpoint_id: 'c1', deadline_ts: h.at() });
      const reply = await post(base, 'commit', {
        checkpoint_id: 'c1',
        deadline_ts: h.at(),
        checkpoint_dir: h.dir('c1'),
        episode_ids: [{ rollout_id: 'r', attempt: 0 }],
      });
      expect(reply.status).toBe(200);
      expect(spy).toHaveBeenCalledTimes(1);
    } finally {
      spy.mockRestore();
    }
  });

  test('an invalid body is 422 invalid_request naming the field', async () => {
    const h = harness();
    const base = await serve(h);
    const reply = await post(base, 'retire', {
      checkpoint_id: 'c1',
      deadline_ts: h.at(),
      episode_ids: [{ rollout_id: 'r' }, { rollout_id: 'bad id' }],
    });
    expect(reply.status).toBe(422);
    expect(reply.body).toEqual({
      error: {
        code: 'invalid_request',
        detail: expect.stringContaining('episode_ids[1].rollout_id'),
      },
    });
    const notJson = await post(base, 'resume', null, { raw: '{"checkpoint_id": NaN}' });
    expect(notJson.status).toBe(422);
    expect(notJson.body).toMatchObject({ error: { code: 'invalid_request' } });
  });

  test('a full prepare, commit, status, resume round trip', async () => {
    const h = harness();
    const base = await serve(h);
    h.participant.start('r-a1', 'parked');
    h.participant.start('s', 'parked');
    const prepare = await post(base, 'prepare', { checkpoint_id: 'c1', deadline_ts: h.at() });
    expect(prepare).toEqual({
      status: 200,
      body: {
        phase: 'prepared',
        report: {
          ready: true,
          blockers: [],
          blocker_count: 0,
          counts: { episodes: 2 },
          restarts: [],
        },
      },
    });
    const commit = await post(base, 'commit', {
      checkpoint_id: 'c1',
      deadline_ts: h.at(),
      checkpoint_dir: h.dir('c1'),
      episode_ids: [{ rollout_id: 's' }, { rollout_id: 'r', attempt: 1 }],
      stop: false,
    });
    expect(commit.status).toBe(200);
    expect(commit.body).toMatchObject({
      phase: 'committed',
      episode_ids: ['r-a1', 's'],
      manifest: { record_count: 2 },
    });
    const renew = await post(base, 'renew', { checkpoint_id: 'c1', deadline_ts: h.at(100) });
    expect(renew.body).toEqual({ lease_expires_at: h.at(160) });
    const resume = await post(base, 'resume', { checkpoint_id: 'c1', deadline_ts: h.at() });
    expect(resume.body).toEqual({ phase: 'idle', idempotent: false });
    const retire = await post(base, 'retire', {
      checkpoint_id: 'c1',
      deadline_ts: h.at(),
      episode_ids: [{ rollout_id: 'r', attempt: 1 }],
    });
    expect(retire.body).toEqual({ retired_count: 1 });
    const forget = await post(base, 'forget', {
      checkpoint_id: 'c1',
      deadline_ts: h.at(),
      rollout_ids: ['r'],
    });
    expect(forget.body).toEqual({ forgotten_count: 1 });
  });

  test('a refusal is a 409 in the standard error shape', async () => {
    const h = harness();
    const base = await serve(h);
    const reply = await post(base, 'commit', {
      checkpoint_id: 'c1',
      deadline_ts: h.at(),
      checkpoint_dir: '/x',
    });
    expect(reply).toEqual({
      status: 409,
      body: { error: { code: 'invalid_phase', detail: 'commit is not valid in phase idle' } },
    });
  });

  test('a participant hook that throws a non-typed error is a typed 409 checkpoint_error naming the operation', async () => {
    const h = harness();
    const base = await serve(h);
    h.participant.retireError = new Error('kaboom');
    const reply = await post(base, 'retire', {
      checkpoint_id: 'c1',
      deadline_ts: h.at(),
      episode_ids: [{ rollout_id: 'r' }],
    });
    expect(reply).toEqual({
      status: 409,
      body: { error: { code: 'checkpoint_error', detail: 'checkpoint retire failed: kaboom' } },
    });
  });

  test('a prepare whose client disconnects reopens admission', async () => {
    const h = harness();
    const base = await serve(h);
    h.participant.start('r');
    const client = new AbortController();
    const request = post(
      base,
      'prepare',
      { checkpoint_id: 'c1', deadline_ts: h.at() },
      { signal: client.signal },
    );
    request.catch(() => undefined);
    await until(() => h.participant.calls.closeAdmission === 1);
    await settle();
    expect(h.participant.admissionOpen).toBe(false);
    client.abort();
    await until(() => h.participant.admissionOpen);
    expect(h.plane.status().phase).toBe('idle');
  });

  test('installing the control routes with an empty token throws', () => {
    const h = harness();
    expect(() => installControlPlane(express(), h.plane, '')).toThrow(
      expect.objectContaining({ code: 'invalid_config' }),
    );
    expect(() => controlRouter(h.plane, { token: '' })).toThrow();
  });
});

describe('every control route refuses invalid requests with a client error', () => {
  const episode = { rollout_id: 'r', attempt: 0 };
  const valid: Record<ControlRoute, Record<string, unknown>> = {
    prepare: { checkpoint_id: 'c1', deadline_ts: 1, restarts: ['x'] },
    renew: { checkpoint_id: 'c1', deadline_ts: 1 },
    resume: { checkpoint_id: 'c1', deadline_ts: 1 },
    retire: { checkpoint_id: 'c1', deadline_ts: 1, episode_ids: [episode] },
    forget: { checkpoint_id: 'c1', deadline_ts: 1, rollout_ids: ['r'] },
    commit: {
      checkpoint_id: 'c1',
      deadline_ts: 1,
      checkpoint_dir: '/c',
      episode_ids: [episode],
      stop: false,
    },
    restore: { checkpoint_id: 'c1', deadline_ts: 1, checkpoint_dir: '/c', episode_ids: [episode] },
  };
  test('a deadline_ts more than MAX_DEADLINE_AHEAD_SECONDS ahead is 422 invalid_request, so the lease is bounded', async () => {
    const h = harness();
    const base = await serve(h);
    const horizon = () => Date.now() / 1000 + MAX_DEADLINE_AHEAD_SECONDS;
    for (const route of CONTROL_ROUTES) {
      for (const deadline_ts of [1e308, horizon() + 60]) {
        const reply = await post(base, route, { ...valid[route], deadline_ts });
        expect([route, reply.status, reply.body]).toEqual([
          route,
          422,
          {
            error: {
              code: 'invalid_request',
              detail: `invalid ${route} request: deadline_ts: must be at most ${MAX_DEADLINE_AHEAD_SECONDS} s from now`,
            },
          },
        ]);
      }
    }
    expect(h.participant.admissionOpen).toBe(true);
    // The furthest deadline allowed gives a lease that ends one grace after it.
    const furthest = horizon() - 60;
    const prepare = await post(base, 'prepare', { checkpoint_id: 'c1', deadline_ts: furthest });
    expect(prepare.status).toBe(200);
    const lease = h.plane.status().lease_expires_at;
    expect(lease).toBe(furthest + 60); // the harness's lease grace
  });

  test.each(['commit', 'restore'] as const)(
    'a %s whose checkpoint_dir holds a NUL byte is 422 invalid_request, not a failed open',
    async (route) => {
      const h = harness();
      const base = await serve(h);
      const reply = await post(base, route, { ...valid[route], checkpoint_dir: '/tmp/c\u0000x' });
      expect(reply).toEqual({
        status: 422,
        body: {
          error: {
            code: 'invalid_request',
            detail: `invalid ${route} request: checkpoint_dir: must not contain a NUL byte`,
          },
        },
      });
    },
  );

  const badEpisode = fc.constantFrom<unknown>(
    {},
    { rollout_id: '' },
    { rollout_id: 'r-a1' },
    { rollout_id: 'a/b' },
    { rollout_id: 'r', attempt: -1 },
    { rollout_id: 'r', attempt: 0.5 },
    { rollout_id: 'r', attempt: '1' },
    { rollout_id: 'r', extra: 1 },
    'r',
    null,
  );
  const badValues: Record<string, fc.Arbitrary<unknown>> = {
    checkpoint_id: fc.constantFrom<unknown>('', '-a', 'a b', 'é', 'x'.repeat(129), 5, null, [], {}),
    deadline_ts: fc.constantFrom<unknown>('1', null, true, [], {}),
    restarts: fc.oneof(
      fc.constantFrom<unknown>('r', null, [5]),
      // Restarts are capture keys: 'r', a bad episode id, is a good capture key.
      badEpisode.filter((e) => e !== 'r').map((e) => [e]),
      fc.constant(['x-a1-a2']),
    ),
    episode_ids: fc.oneof(
      fc.constantFrom<unknown>('r', 5, {}),
      badEpisode.map((e) => [episode, e]),
    ),
    rollout_ids: fc.constantFrom<unknown>([], 'r', [5], null, [null]),
    checkpoint_dir: fc.constantFrom<unknown>('', 5, null, []),
    stop: fc.constantFrom<unknown>('true', 1, null),
  };

  /** One invalid body for `route`: a field dropped, added, or given a bad value, or no object at all. */
  function invalidBody(route: ControlRoute): fc.Arbitrary<{ raw: string }> {
    const body = valid[route];
    const fields = Object.keys(body);
    const required = fields.filter(
      (f) => !['restarts', 'stop'].includes(f) && !(route === 'commit' && f === 'episode_ids'),
    );
    const drop = fc.constantFrom(...required).map((f) => {
      const copy = { ...body };
      delete copy[f];
      return copy;
    });
    const add = fc
      .tuple(
        fc.string({ minLength: 1 }).filter((k) => !fields.includes(k) && k !== '__proto__'),
        fc.jsonValue(),
      )
      .map(([k, v]) => ({ ...body, [k]: v }));
    const replace = fc
      .constantFrom(...fields.filter((f) => !(route === 'commit' && f === 'episode_ids')))
      .chain((f) => (badValues[f] as fc.Arbitrary<unknown>).map((v) => ({ ...body, [f]: v })));
    const notObject = fc.oneof(
      fc.array(fc.jsonValue(), { maxLength: 3 }),
      fc.string(),
      fc.integer(),
      fc.constant(null),
    );
    return fc.oneof(
      fc.oneof(drop, add, replace, notObject).map((value) => ({ raw: JSON.stringify(value) })),
      fc
        .string()
        .filter((s) => {
          try {
            JSON.parse(s);
            return false;
          } catch {
            return s.trim() !== '';
          }
        })
        .map((raw) => ({ raw })),
    );
  }

  test('random invalid bodies get 422 invalid_request on every route', async () => {
    const h = harness();
    const base = await serve(h);
    await fc.assert(
      fc.asyncProperty(
        fc
          .constantFrom(...CONTROL_ROUTES)
          .chain((route) => invalidBody(route).map((body) => ({ route, ...body }))),
        async ({ route, raw }) => {
          const reply = await post(base, route, null, { raw });
          expect([
            route,
            raw,
            reply.status,
            (reply.body.error as { code?: string } | undefined)?.code,
          ]).toEqual([route, raw, 422, 'invalid_request']);
        },
      ),
      { numRuns: 300 },
    );
    // Nothing reached the participant.
    expect(
      h.participant.calls.closeAdmission +
        h.participant.calls.retire.length +
        h.participant.calls.checkForget,
    ).toBe(0);
  });
});
