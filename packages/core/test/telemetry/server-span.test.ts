/**
 * The compact server span of a data-plane request, on its own: what it records before it ends
 * (as the SDK's span would), that nothing changes it after, and how the sampler decides it.
 */
import { ROOT_CONTEXT, type Span, SpanKind, SpanStatusCode, trace } from '@opentelemetry/api';
import { hrTimeToMilliseconds, suppressTracing } from '@opentelemetry/core';
import { AlwaysOffSampler, type ReadableSpan } from '@opentelemetry/sdk-trace-base';

import { startServerSpan } from '../../src/telemetry/server-span.js';
import { recorderWith } from './recorder.js';

const CALLER = { traceId: 'ab'.repeat(16), spanId: 'cd'.repeat(8), traceFlags: 1, isRemote: true };

const fromCaller = trace.setSpanContext(ROOT_CONTEXT, CALLER);

describe('a server span', () => {
  it('is a child of its caller in the caller’s trace, with the attributes it started with', () => {
    const { recorder, exported } = recorderWith();
    startServerSpan(recorder, 'POST /v1/x', { 'http.route': '/v1/x' }, fromCaller).end();
    const [span] = exported() as [ReadableSpan];
    expect(span.kind).toBe(SpanKind.SERVER);
    expect(span.spanContext().traceId).toBe(CALLER.traceId);
    expect(span.spanContext().spanId).toMatch(/^[0-9a-f]{16}$/);
    expect(span.parentSpanContext).toEqual(CALLER);
    expect(span.attributes).toEqual({ 'http.route': '/v1/x' });
    expect(span.resource).toBe(recorder.resource);
    expect(span.instrumentationScope).toBe(recorder.scope);
  });

  it('without a caller starts its own trace and has no parent', () => {
    const { recorder, exported } = recorderWith();
    startServerSpan(recorder, 'GET /x', {}, ROOT_CONTEXT).end();
    const [span] = exported() as [ReadableSpan];
    expect(span.spanContext().traceId).toMatch(/^[0-9a-f]{32}$/);
    expect(span.spanContext().traceId).not.toBe(CALLER.traceId);
    expect(span.parentSpanContext).toBeUndefined();
  });

  it('records attributes, events, an exception, links, its name and status until it ends, as the SDK’s span', () => {
    const { recorder, exported } = recorderWith();
    const span = startServerSpan(recorder, 'POST /x', {}, fromCaller);
    span
      .setAttribute('http.response.status_code', 503)
      .setAttributes({ a: 'b', skipped: undefined });
    span.addEvent('retry', { attempt: 2 });
    span.addEvent('timed', [1_700_000_000, 500_000_000]);
    span.recordException(Object.assign(new Error('backend down'), { code: 'ECONNREFUSED' }));
    span.addLink({ context: CALLER });
    span.updateName('POST /y');
    span.setStatus({ code: SpanStatusCode.ERROR, message: 'upstream' });
    span.setStatus({ code: SpanStatusCode.UNSET });
    span.end();
    const [done] = exported() as [ReadableSpan];
    expect(done.name).toBe('POST /y');
    expect(done.attributes).toEqual({ 'http.response.status_code': 503, a: 'b' });
    expect(done.status).toEqual({ code: SpanStatusCode.ERROR, message: 'upstream' });
    expect(done.events.map((event) => [event.name, event.attributes])).toEqual([
      ['retry', { attempt: 2 }],
      ['timed', {}],
      [
        'exception',
        expect.objectContaining({
          'exception.type': 'ECONNREFUSED',
          'exception.message': 'backend down',
        }),
      ],
    ]);
    expect(done.events[1]!.time).toEqual([1_700_000_000, 500_000_000]);
    expect(done.links).toEqual([{ context: CALLER }]);
  });

  it('once OK keeps its status, and once ended changes no more and is exported once', () => {
    const { recorder, exported } = recorderWith();
    const span: Span = startServerSpan(recorder, 'POST /x', {}, fromCaller);
    span.setStatus({ code: SpanStatusCode.OK });
    span.setStatus({ code: SpanStatusCode.ERROR, message: 'late' });
    expect(span.isRecording()).toBe(true);
    span.end();
    span.setAttribute('after', 1).addEvent('after').updateName('after');
    span.end();
    expect(span.isRecording()).toBe(false);
    const [done, ...more] = exported();
    expect(more).toEqual([]);
    expect(done!.status).toEqual({ code: SpanStatusCode.OK });
    expect([done!.name, done!.attributes, done!.events]).toEqual(['POST /x', {}, []]);
    expect(done!.ended).toBe(true);
    const [start, end] = [
      hrTimeToMilliseconds(done!.startTime),
      hrTimeToMilliseconds(done!.endTime),
    ];
    expect(end).toBeGreaterThanOrEqual(start);
    expect(hrTimeToMilliseconds(done!.duration)).toBeCloseTo(end - start, 3);
  });

  it('dropped by the sampler, it records nothing yet carries its trace on; suppressed, it is invalid', () => {
    const { recorder, exported } = recorderWith(new AlwaysOffSampler());
    const dropped = startServerSpan(recorder, 'POST /x', {}, fromCaller);
    dropped.end();
    expect(dropped.isRecording()).toBe(false);
    expect(dropped.spanContext()).toMatchObject({ traceId: CALLER.traceId, traceFlags: 0 });
    expect(exported()).toEqual([]);
    const suppressed = startServerSpan(
      recorderWith().recorder,
      'POST /x',
      {},
      suppressTracing(fromCaller),
    );
    expect(trace.isSpanContextValid(suppressed.spanContext())).toBe(false);
  });
});
