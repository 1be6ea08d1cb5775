/**
 * One server span per data-plane request, opened by the route's first handler: its parent is the
 * caller's `traceparent` (so one rollout's calls from environment to agent to policy and resources
 * are one trace), named `<METHOD> <route template>` as the HTTP conventions name server spans.
 *
 * A request's span is started only when something needs it: its first call to another server
 * (which carries the span's `traceparent` on), else the batch it ends in. The request itself pays
 * for one small object held by its scope (`request-id.ts`) and three clock readings; taking the
 * caller's context from the headers, sampling, the ids, the span and handing it to the span
 * processor run a batch of requests at a time, where that code stays warm (in the whole stack,
 * run cold once per request, it cost several times its hot-loop time: docs/telemetry.md, Cost).
 * The span is not made the active one in the handlers' context: no SDK span starts inside a
 * data-plane request, and its calls take their trace headers from the scope.
 */
import type { IncomingHttpHeaders } from 'node:http';

import {
  type Attributes,
  context,
  propagation,
  ROOT_CONTEXT,
  type Span,
  SpanStatusCode,
  trace,
  TraceFlags,
} from '@opentelemetry/api';
import {
  ATTR_HTTP_REQUEST_METHOD,
  ATTR_HTTP_RESPONSE_STATUS_CODE,
  ATTR_HTTP_ROUTE,
} from '@opentelemetry/semantic-conventions';
import type { RequestHandler } from 'express';

import { captureKey, type EpisodeId, requestEpisode } from '../identity.js';
import { currentRequestScope } from './request-id.js';
import { type SpanRecorder, startServerSpan } from './server-span.js';
import { spanRecorder, tracingOn } from './tracing.js';

/** The episode a data-plane request is part of (its `/ng-rollout/<key>` prefix). */
export const ATTR_CAPTURE_KEY = 'nemo.gym.capture_key';

/** What a request's calls take their trace headers from (`traceparent`, `tracestate`). */
export interface TraceCarrier {
  traceHeaders(): Readonly<Record<string, string>>;
}

/** A W3C `traceparent` of version 00: version, trace id, parent id, flags. */
const TRACEPARENT_V00 = /^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$/;

/** A caller's trace context, passed on as it came; its headers are built only if a call needs them. */
class CallerTrace implements TraceCarrier {
  constructor(
    readonly traceparent: string,
    readonly tracestate: string | undefined,
  ) {}

  traceHeaders(): Readonly<Record<string, string>> {
    const { traceparent, tracestate } = this;
    return tracestate === undefined ? { traceparent } : { traceparent, tracestate };
  }
}

/**
 * The caller's trace context when `traceparent` is a valid one whose sampled flag is off, else
 * undefined. Under a parent-based sampler such a request records nothing, so it needs no span: its
 * calls carry the caller's trace context on, unsampled, and the rollout stays one trace.
 */
export function unsampledCallerTrace(headers: IncomingHttpHeaders): TraceCarrier | undefined {
  const traceparent = headers.traceparent;
  if (typeof traceparent !== 'string' || !TRACEPARENT_V00.test(traceparent)) return undefined;
  if ((Number.parseInt(traceparent.slice(53), 16) & TraceFlags.SAMPLED) !== 0) return undefined;
  const tracestate = headers.tracestate;
  return new CallerTrace(traceparent, typeof tracestate === 'string' ? tracestate : undefined);
}

/** A data-plane request's server span, started on first need (see the file comment). */
export class RequestSpan implements TraceCarrier {
  /**
   * Timed as the SDK times its spans: the wall clock at the start, then the monotonic clock's
   * duration. (The monotonic clock from the process's time origin drifts from the wall clock, by
   * 0.15 s in a test process, which would misplace these spans against every other span.)
   */
  readonly #startMs = Date.now();
  readonly #startedAt = performance.now();
  #span: Span | undefined;
  #traceHeaders: Readonly<Record<string, string>> | undefined;

  constructor(
    readonly recorder: SpanRecorder,
    readonly method: string,
    readonly route: string,
    /** The request's headers: the caller's trace context, read when the span starts. */
    readonly callerHeaders: IncomingHttpHeaders,
    readonly episode: EpisodeId | undefined,
  ) {}

  /** The span, started from the request's start time under the caller's trace context. */
  span(): Span {
    if (this.#span !== undefined) return this.#span;
    const attributes: Attributes = {
      [ATTR_HTTP_REQUEST_METHOD]: this.method,
      [ATTR_HTTP_ROUTE]: this.route,
    };
    if (this.episode !== undefined) attributes[ATTR_CAPTURE_KEY] = captureKey(this.episode);
    const parent = propagation.extract(ROOT_CONTEXT, this.callerHeaders);
    const name = `${this.method} ${this.route}`;
    this.#span = startServerSpan(this.recorder, name, attributes, parent, this.#startMs);
    return this.#span;
  }

  /** The trace headers the request's calls carry (`traceparent`, `tracestate`), built once. */
  traceHeaders(): Readonly<Record<string, string>> {
    if (this.#traceHeaders === undefined) {
      const headers: Record<string, string> = {};
      propagation.inject(trace.setSpan(ROOT_CONTEXT, this.span()), headers);
      this.#traceHeaders = headers;
    }
    return this.#traceHeaders;
  }

  /**
   * Ends the span with the reply's status (a 5xx marks it failed) at this time, with the process's
   * next batch of ended request spans (`SpanBatch`).
   */
  end(statusCode: number): void {
    const endMs = this.#startMs + (performance.now() - this.#startedAt);
    this.recorder.batch.add(() => {
      const span = this.span();
      span.setAttribute(ATTR_HTTP_RESPONSE_STATUS_CODE, statusCode);
      if (statusCode >= 500) span.setStatus({ code: SpanStatusCode.ERROR });
      span.end(endMs);
    });
  }
}

/**
 * The route's first handler: while tracing is on, gives the request its span, ended when the
 * response closes, and held by the request's scope (a gym app's first middleware) for the calls
 * its work makes; a request whose caller's trace is not sampled gets none, only the caller's trace
 * headers to pass on (under a parent-based sampler, the default). Never answers.
 */
export function traceRequest(route: string): RequestHandler {
  return (req, res, next) => {
    const recorder = spanRecorder();
    if (recorder !== undefined) {
      const scope = currentRequestScope();
      const unsampled = recorder.followsParent ? unsampledCallerTrace(req.headers) : undefined;
      if (unsampled !== undefined) {
        if (scope !== undefined) scope.span = unsampled;
      } else {
        const span = new RequestSpan(recorder, req.method, route, req.headers, requestEpisode(req));
        if (scope !== undefined) scope.span = span;
        res.once('close', () => span.end(res.statusCode));
      }
    }
    next();
  };
}

/**
 * The trace headers a call made now carries: the active SDK span's (a control operation's, the
 * CLI's), else the span of the request being served; none outside both or while tracing is off.
 */
function outgoingTraceHeaders(): Readonly<Record<string, string>> | undefined {
  if (!tracingOn()) return undefined;
  const active = context.active();
  if (trace.getSpan(active) === undefined) return currentRequestScope()?.span?.traceHeaders();
  const headers: Record<string, string> = {};
  propagation.inject(active, headers);
  return headers;
}

/**
 * Writes the current trace context into outgoing `headers` (`traceparent`, `tracestate`): the got
 * clients' `beforeRequest` hook, so every call a traced request makes joins its trace.
 */
export function injectTraceContext(headers: Record<string, unknown>): void {
  const carried = outgoingTraceHeaders();
  if (carried !== undefined) Object.assign(headers, carried);
}

/**
 * `headers` with the current trace context added, for a call made without core's got clients (a
 * copy while tracing is on; the same object, untouched, while it is off).
 */
export function withTraceContext<H extends Record<string, unknown>>(headers: H): H {
  const carried = outgoingTraceHeaders();
  return carried === undefined ? headers : { ...headers, ...carried };
}
