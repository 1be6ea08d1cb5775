/**
 * A data-plane request's span on its own: started only when first needed (its first call's trace
 * headers, else the batch it ends in), yet timed from the request's start to its end and a child
 * of its caller; and the batch ended spans wait in.
 */
import { setTimeout as sleep } from 'node:timers/promises';

import { jest } from '@jest/globals';
import { SpanStatusCode } from '@opentelemetry/api';
import { hrTimeToMilliseconds } from '@opentelemetry/core';
import { AlwaysOnSampler, type ReadableSpan } from '@opentelemetry/sdk-trace-base';

import { episodeId } from '../../src/identity.js';
import { ATTR_CAPTURE_KEY, RequestSpan } from '../../src/telemetry/request-spans.js';
import {
  SPAN_BATCH_DELAY_MS,
  SPAN_BATCH_SIZE,
  SpanBatch,
} from '../../src/telemetry/server-span.js';
import { recorderWith } from './recorder.js';
import { useInMemoryTracing } from './spans.js';

// The API's global propagator (W3C trace context), as a running process has it.
useInMemoryTracing();

const CALLER = `00-${'ab'.repeat(16)}-${'cd'.repeat(8)}-01`;

function spiedRecorder() {
  const sampler = new AlwaysOnSampler();
  const sampled = jest.spyOn(sampler, 'shouldSample');
  return { ...recorderWith(sampler), sampled };
}

describe('a request span', () => {
  it('is started by its first call’s trace headers, which name it, and ended once', () => {
    const { recorder, sampled, exported } = spiedRecorder();
    const request = new RequestSpan(recorder, 'POST', '/run', { traceparent: CALLER }, undefined);
    expect(sampled).not.toHaveBeenCalled();
    const headers = request.traceHeaders();
    expect(sampled).toHaveBeenCalledTimes(1);
    expect(request.traceHeaders()).toBe(headers);
    request.end(200);
    recorder.batch.flush();
    const [span] = exported() as [ReadableSpan];
    expect(headers.traceparent).toBe(`00-${'ab'.repeat(16)}-${span.spanContext().spanId}-01`);
    expect(span.parentSpanContext?.spanId).toBe('cd'.repeat(8));
    expect(sampled).toHaveBeenCalledTimes(1);
  });

  it('is timed as the SDK times its spans: the wall clock at its start, however far the monotonic clock has drifted', async () => {
    const { recorder, exported } = spiedRecorder();
    const monotonic = performance.now.bind(performance);
    const drifted = jest.spyOn(performance, 'now').mockImplementation(() => monotonic() + 5_000);
    try {
      const opened = Date.now();
      const request = new RequestSpan(recorder, 'POST', '/verify', {}, undefined);
      await sleep(20);
      request.end(200);
      const ended = Date.now();
      recorder.batch.flush();
      const [span] = exported() as [ReadableSpan];
      expect(hrTimeToMilliseconds(span.startTime)).toBeGreaterThanOrEqual(opened);
      expect(hrTimeToMilliseconds(span.endTime)).toBeLessThanOrEqual(ended + 1);
      expect(hrTimeToMilliseconds(span.duration)).toBeGreaterThanOrEqual(15);
    } finally {
      drifted.mockRestore();
    }
  });

  it('without a call is started at its end, timed from the request’s start, with its status', async () => {
    const { recorder, sampled, exported } = spiedRecorder();
    const episode = episodeId('r-1', 2);
    const opened = Date.now();
    const request = new RequestSpan(recorder, 'POST', '/verify', { traceparent: CALLER }, episode);
    await sleep(30);
    request.end(503);
    const ended = Date.now();
    await sleep(30);
    expect(sampled).not.toHaveBeenCalled();
    expect(exported()).toEqual([]);
    recorder.batch.flush();
    const [span] = exported() as [ReadableSpan];
    expect(span.name).toBe('POST /verify');
    expect(hrTimeToMilliseconds(span.startTime)).toBeLessThanOrEqual(opened + 1);
    expect(hrTimeToMilliseconds(span.duration)).toBeGreaterThanOrEqual(25);
    expect(hrTimeToMilliseconds(span.endTime)).toBeLessThanOrEqual(ended + 1);
    expect(span.spanContext().traceId).toBe('ab'.repeat(16));
    expect(span.status.code).toBe(SpanStatusCode.ERROR);
    expect(span.attributes).toMatchObject({
      'http.request.method': 'POST',
      'http.route': '/verify',
      'http.response.status_code': 503,
      [ATTR_CAPTURE_KEY]: 'r-1-a2',
    });
  });
});

describe('a span batch', () => {
  it('runs its work when full, else once its delay has passed after the first', async () => {
    const batch = new SpanBatch();
    const ran: number[] = [];
    for (let i = 0; i < SPAN_BATCH_SIZE - 1; i += 1) batch.add(() => ran.push(i));
    expect(ran).toEqual([]);
    batch.add(() => ran.push(SPAN_BATCH_SIZE - 1));
    expect(ran).toHaveLength(SPAN_BATCH_SIZE);
    batch.add(() => ran.push(-1));
    expect(ran).toHaveLength(SPAN_BATCH_SIZE);
    await sleep(SPAN_BATCH_DELAY_MS + 50);
    expect(ran.at(-1)).toBe(-1);
  });
});
