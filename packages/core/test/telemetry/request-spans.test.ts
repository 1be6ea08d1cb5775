/**
 * Data-plane traces through real HTTP: a gym route's server span (route template, status, capture
 * key), and the W3C trace context a route's upstream call carries on core's got clients, so one
 * rollout's calls across servers are one trace.
 */
import { once } from 'node:events';
import type { IncomingHttpHeaders, Server } from 'node:http';
import type { AddressInfo } from 'node:net';

import { jest } from '@jest/globals';
import { propagation, SpanKind } from '@opentelemetry/api';
import { hrTimeToMilliseconds } from '@opentelemetry/core';
import express from 'express';

import { createHttpClients, type HttpClients, postUpstream } from '../../src/http-client.js';
import { captureKey, rolloutPrefixMiddleware } from '../../src/identity.js';
import { gymRoute, type GymRoute, mountRoutes } from '../../src/route.js';
import { requestTelemetry } from '../../src/telemetry/http.js';
import { currentRequestScope } from '../../src/telemetry/request-id.js';
import { GymMetrics } from '../../src/telemetry/metrics.js';
import {
  ATTR_CAPTURE_KEY,
  RequestSpan,
  unsampledCallerTrace,
} from '../../src/telemetry/request-spans.js';
import { SPAN_BATCH_DELAY_MS } from '../../src/telemetry/server-span.js';
import { inSpan, spanRecorder } from '../../src/telemetry/tracing.js';
import { captureLogLines } from '../support/log-lines.js';
import {
  named,
  one,
  parentOf,
  sampleRolloutsAt,
  traceId,
  useInMemoryTracing,
  waitForSpans,
} from './spans.js';

useInMemoryTracing();

const servers: Server[] = [];
let clients: HttpClients;

beforeEach(() => {
  clients = createHttpClients();
});

afterEach(() => {
  clients.close();
  for (const server of servers.splice(0)) {
    server.closeAllConnections();
    server.close();
  }
});

/** A server of `routes` behind the middleware every gym app starts with (the request's scope). */
async function serve(routes: GymRoute[]): Promise<string> {
  const app = express();
  const metrics = new GymMetrics({ server: 'traced', kind: 'agent' });
  app.use(requestTelemetry(metrics, captureLogLines().logger));
  app.use(rolloutPrefixMiddleware());
  mountRoutes(app, routes);
  const server = app.listen(0, '127.0.0.1');
  servers.push(server);
  await once(server, 'listening');
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
}

/** A downstream server echoing the trace context it was sent. */
function echoRoute(): GymRoute {
  return gymRoute({
    method: 'post',
    path: '/v1/echo',
    body: { limit: '1mb', parse: (body) => body },
    episode: 'optional',
    run: ({ req }) => ({
      traceparent: req.headers.traceparent ?? null,
      ...(req.headers.tracestate === undefined ? {} : { tracestate: req.headers.tracestate }),
    }),
  });
}

/**
 * A route that says whether its request's span records (null: the request has no span), then
 * calls `downstream`'s echo and answers with the trace context that call carried.
 */
function probeRoute(downstream: string): GymRoute {
  return gymRoute({
    method: 'post',
    path: '/probe',
    episode: 'none',
    run: async ({ signal }) => {
      const span = currentRequestScope()?.span;
      const recording = span instanceof RequestSpan ? span.span().isRecording() : null;
      const reply = await postUpstream(clients.data, `${downstream}/v1/echo`, { json: {}, signal });
      return { recording, ...(JSON.parse(reply.body) as object) };
    },
  });
}

/** An upstream route that reads its body, then calls `downstream` on the data client. */
function relayRoute(downstream: string): GymRoute {
  return gymRoute({
    method: 'post',
    path: '/run',
    body: { limit: '1mb', parse: (body) => body },
    episode: 'required',
    run: async ({ episode, signal }) => {
      const key = captureKey(episode!);
      const reply = await postUpstream(clients.data, `${downstream}/ng-rollout/${key}/v1/echo`, {
        json: {},
        signal,
      });
      return JSON.parse(reply.body) as object;
    },
  });
}

/**
 * Serves an echo and a relay to it, then posts `/run` for episode `key` to the relay (with
 * `headers`); resolves to the trace context the relay's call carried.
 */
async function relayedRun(
  key: string,
  headers: Record<string, string> = {},
): Promise<{ traceparent: string | null }> {
  const upstream = await serve([relayRoute(await serve([echoRoute()]))]);
  return clients.data
    .post(`${upstream}/ng-rollout/${key}/run`, { json: {}, headers })
    .json<{ traceparent: string | null }>();
}

describe('data-plane spans', () => {
  it('a route’s span names its template, status and capture key', async () => {
    const url = await serve([echoRoute()]);
    const reply = await clients.data.post(`${url}/ng-rollout/r-1-a2/v1/echo`, { json: {} });
    expect(reply.statusCode).toBe(200);
    await waitForSpans('POST /v1/echo', 1);
    const span = one('POST /v1/echo');
    expect(span.kind).toBe(SpanKind.SERVER);
    expect(span.attributes).toMatchObject({
      'http.request.method': 'POST',
      'http.route': '/v1/echo',
      'http.response.status_code': 200,
      [ATTR_CAPTURE_KEY]: 'r-1-a2',
    });
  });

  it('a route served without a gym app’s first middleware has its span too', async () => {
    const app = express();
    mountRoutes(app, [echoRoute()]);
    const server = app.listen(0, '127.0.0.1');
    servers.push(server);
    await once(server, 'listening');
    const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
    await clients.data.post(`${url}/v1/echo`, { json: {} });
    await waitForSpans('POST /v1/echo', 1);
    expect(one('POST /v1/echo').attributes['http.response.status_code']).toBe(200);
  });

  it('a call a route makes upstream carries its trace context: the downstream span is its child', async () => {
    const reply = await relayedRun('r-2');
    await waitForSpans('POST /run', 1);
    await waitForSpans('POST /v1/echo', 1);

    const run = one('POST /run');
    const echo = one('POST /v1/echo');
    expect(parentOf(echo)).toBe(run);
    expect(traceId(echo)).toBe(traceId(run));
    expect(reply.traceparent).toBe(`00-${traceId(run)}-${run.spanContext().spanId}-01`);
    expect(echo.attributes[ATTR_CAPTURE_KEY]).toBe('r-2');
  });

  it('a request’s calls carry its trace context, built once for all of them', async () => {
    const downstream = await serve([echoRoute()]);
    const twice = gymRoute({
      method: 'post',
      path: '/twice',
      episode: 'none',
      run: async ({ signal }) => {
        const call = () =>
          postUpstream(clients.data, `${downstream}/v1/echo`, { json: {}, signal });
        const replies = [await call(), await call()];
        return replies.map((reply) => JSON.parse(reply.body) as object);
      },
    });
    const upstream = await serve([twice]);
    const inject = jest.spyOn(propagation, 'inject');
    try {
      const replies = await clients.data.post(`${upstream}/twice`, { json: {} }).json<object[]>();
      await waitForSpans('POST /twice', 1);
      const run = one('POST /twice');
      const traceparent = `00-${traceId(run)}-${run.spanContext().spanId}-01`;
      expect(replies).toEqual([{ traceparent }, { traceparent }]);
      expect(inject).toHaveBeenCalledTimes(1);
    } finally {
      inject.mockRestore();
    }
  });

  it('a client’s own span is the parent of the first server’s span', async () => {
    const url = await serve([echoRoute()]);
    await inSpan('client', {}, () => clients.data.post(`${url}/v1/echo`, { json: {} }));
    await waitForSpans('POST /v1/echo', 1);
    expect(parentOf(one('POST /v1/echo'))).toBe(one('client'));
  });

  it('a request without a traceparent starts its own trace, even on a server started in a span', async () => {
    const url = await inSpan('startup', {}, () => serve([echoRoute()]));
    await clients.data.post(`${url}/v1/echo`, { json: {} });
    await waitForSpans('POST /v1/echo', 1);
    expect(one('POST /v1/echo').parentSpanContext).toBeUndefined();
  });

  it('a caller’s unsampled traceparent records no span and is passed on unsampled (parent-based sampling)', async () => {
    const caller = `00-${'ab'.repeat(16)}-${'cd'.repeat(8)}-00`;
    const reply = await relayedRun('r-3', { traceparent: caller });
    expect(reply.traceparent).toMatch(new RegExp(`^00-${'ab'.repeat(16)}-[0-9a-f]{16}-00$`));
    await inSpan('after', {}, async () => {});
    await waitForSpans('after', 1);
    expect(named('POST /run')).toEqual([]);
    expect(named('POST /v1/echo')).toEqual([]);
  });

  it('a route’s span is exported as the SDK’s spans are: their resource and scope, its times in the request', async () => {
    const url = await serve([echoRoute()]);
    const before = Date.now();
    await inSpan('client', {}, () => clients.data.post(`${url}/v1/echo`, { json: {} }));
    await waitForSpans('POST /v1/echo', 1);
    const after = Date.now();
    const [span, client] = [one('POST /v1/echo'), one('client')];
    expect(span.resource).toBe(client.resource);
    expect(span.instrumentationScope).toEqual(client.instrumentationScope);
    const start = hrTimeToMilliseconds(span.startTime);
    const end = hrTimeToMilliseconds(span.endTime);
    expect(start).toBeGreaterThanOrEqual(before - 1);
    expect(end).toBeGreaterThanOrEqual(start);
    expect(end).toBeLessThanOrEqual(after + 1);
    expect(hrTimeToMilliseconds(span.duration)).toBeCloseTo(end - start, 3);
    expect(span.ended).toBe(true);
  });

  it('a failed route’s span says its status', async () => {
    const url = await serve([echoRoute()]);
    const reply = await clients.data.post(`${url}/v1/echo`, {
      body: 'not json',
      headers: { 'content-type': 'application/json' },
      throwHttpErrors: false,
    });
    expect(reply.statusCode).toBe(422);
    await waitForSpans('POST /v1/echo', 1);
    expect(named('POST /v1/echo')[0]!.attributes['http.response.status_code']).toBe(422);
  });
});

describe('data-plane spans with OTEL_TRACES_SAMPLER=always_off', () => {
  let saved: string | undefined;
  beforeAll(() => {
    saved = process.env.OTEL_TRACES_SAMPLER;
    process.env.OTEL_TRACES_SAMPLER = 'always_off';
  });
  afterAll(() => {
    if (saved === undefined) delete process.env.OTEL_TRACES_SAMPLER;
    else process.env.OTEL_TRACES_SAMPLER = saved;
  });

  it('a route’s span does not record, yet its calls pass a trace context on', async () => {
    const upstream = await serve([probeRoute(await serve([echoRoute()]))]);
    const reply = await clients.data
      .post(`${upstream}/probe`, { json: {} })
      .json<{ recording: boolean | null; traceparent: string | null }>();
    expect(reply.recording).toBe(false);
    expect(reply.traceparent).toMatch(/^00-[0-9a-f]{32}-[0-9a-f]{16}-00$/);
    expect(named('POST /probe')).toEqual([]);
  });
});

describe('rollouts sampled at a ratio (the stack file’s rollout_sample_ratio)', () => {
  describe('at 0', () => {
    sampleRolloutsAt(0);

    it('a request that begins a trace records no span; its calls carry that trace on, unsampled', async () => {
      const reply = await relayedRun('r-4');
      expect(reply.traceparent).toMatch(/^00-[0-9a-f]{32}-[0-9a-f]{16}-00$/);
      await inSpan('after', {}, async () => {});
      await new Promise((resolve) => setTimeout(resolve, SPAN_BATCH_DELAY_MS * 2));
      expect(named('POST /run')).toEqual([]);
      expect(named('POST /v1/echo')).toEqual([]);
      expect(named('after')).toHaveLength(1);
    });

    it('a caller’s sampled trace is followed: its requests are recorded, as a checkpoint’s are', async () => {
      await inSpan('checkpoint', {}, () => relayedRun('r-5'));
      await waitForSpans('POST /v1/echo', 1);
      expect(parentOf(one('POST /v1/echo'))).toBe(one('POST /run'));
      expect(parentOf(one('POST /run'))).toBe(one('checkpoint'));
    });
  });

  describe('at 1', () => {
    sampleRolloutsAt(1);

    it('samples by an always-on root, not by trace id (the SDK’s ratio of 1 drops one id in 2^32)', () => {
      expect(spanRecorder()!.sampler.toString()).toMatch(/^ParentBased\{root=AlwaysOnSampler,/);
    });

    it('every request that begins a trace records its span, and its calls’ spans under it', async () => {
      await relayedRun('r-6');
      await waitForSpans('POST /v1/echo', 1);
      expect(parentOf(one('POST /v1/echo'))).toBe(one('POST /run'));
    });
  });
});

describe('a request under an unsampled caller', () => {
  const caller = `00-${'ab'.repeat(16)}-${'cd'.repeat(8)}-00`;

  it('makes no span of its own: its calls carry the caller’s traceparent and tracestate as they came', async () => {
    const upstream = await serve([probeRoute(await serve([echoRoute()]))]);
    const reply = await clients.data
      .post(`${upstream}/probe`, { json: {}, headers: { traceparent: caller, tracestate: 'k=v' } })
      .json<object>();
    expect(reply).toEqual({ recording: null, traceparent: caller, tracestate: 'k=v' });
  });

  it('is told by its traceparent: a valid version-00 header whose sampled flag is off', () => {
    const passedOn = (headers: IncomingHttpHeaders) =>
      unsampledCallerTrace(headers)?.traceHeaders();
    expect(passedOn({ traceparent: caller })).toEqual({ traceparent: caller });
    expect(passedOn({ traceparent: caller, tracestate: 'k=v' })).toEqual({
      traceparent: caller,
      tracestate: 'k=v',
    });
    const flags02 = caller.replace(/-00$/, '-02');
    expect(passedOn({ traceparent: flags02 })).toEqual({ traceparent: flags02 });
    for (const traceparent of [
      caller.replace(/-00$/, '-01'),
      caller.replace(/-00$/, '-03'),
      `00-${'0'.repeat(32)}-${'cd'.repeat(8)}-00`,
      `00-${'ab'.repeat(16)}-${'0'.repeat(16)}-00`,
      `01-${'ab'.repeat(16)}-${'cd'.repeat(8)}-00`,
      caller.toUpperCase(),
      `${caller}-extra`,
      '',
    ]) {
      expect(unsampledCallerTrace({ traceparent })).toBeUndefined();
    }
    expect(unsampledCallerTrace({})).toBeUndefined();
  });
});
