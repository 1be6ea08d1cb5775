/**
 * The server span of a data-plane request, kept small. A rollout makes a dozen of them, and the
 * SDK's span (limits checked and attributes copied twice at start, three time pairs, a status and
 * span-context object, metrics callbacks, a dozen objects that live until the batch is exported)
 * costs a server several times what the request needs. This one keeps its name, ids, attributes
 * and two times (epoch ms), and turns them into the SDK's `ReadableSpan` only when its batch is
 * exported: the same sampler, span processor, resource and scope as the SDK's own spans, so the
 * batch processor and OTLP exporter see one kind of span.
 */
import {
  type Attributes,
  type AttributeValue,
  type Context,
  type Exception,
  type HrTime,
  INVALID_SPAN_CONTEXT,
  type Link,
  type Span,
  type SpanContext,
  SpanKind,
  type SpanStatus,
  SpanStatusCode,
  type TimeInput,
  trace,
  TraceFlags,
} from '@opentelemetry/api';
import {
  hrTimeDuration,
  type InstrumentationScope,
  isTracingSuppressed,
  millisToHrTime,
  timeInputToHrTime,
} from '@opentelemetry/core';
import type { Resource } from '@opentelemetry/resources';
import {
  type IdGenerator,
  type ReadableSpan,
  type Sampler,
  SamplingDecision,
  type SpanProcessor,
  type TimedEvent,
} from '@opentelemetry/sdk-trace-base';
import {
  ATTR_EXCEPTION_MESSAGE,
  ATTR_EXCEPTION_STACKTRACE,
  ATTR_EXCEPTION_TYPE,
} from '@opentelemetry/semantic-conventions';

/** What a server span shares with the SDK's spans of the same process. */
export interface SpanRecorder {
  readonly resource: Resource;
  readonly scope: InstrumentationScope;
  /** Samples the request spans (the data plane's): see `requestSampler` in `tracing.ts`. */
  readonly sampler: Sampler;
  /**
   * Whether `sampler` keeps its caller's decision (parent-based): then a request whose caller's
   * trace is not sampled needs no span at all.
   */
  readonly followsParent: boolean;
  readonly processor: SpanProcessor;
  readonly ids: IdGenerator;
  /** Where ended request spans wait to be recorded (`request-spans.ts`). */
  readonly batch: SpanBatch;
}

/** Ended request spans wait at most this long to be recorded... */
export const SPAN_BATCH_DELAY_MS = 100;
/** ...or until this many wait. */
export const SPAN_BATCH_SIZE = 64;

/**
 * Work on ended request spans, run a batch at a time: when SPAN_BATCH_SIZE wait, SPAN_BATCH_DELAY_MS
 * after the first of them, or at `flush` (tracing's shutdown). The timer never keeps a process up.
 */
export class SpanBatch {
  #waiting: (() => void)[] = [];
  #timer: NodeJS.Timeout | undefined;

  add(work: () => void): void {
    this.#waiting.push(work);
    if (this.#waiting.length >= SPAN_BATCH_SIZE) this.flush();
    else this.#timer ??= setTimeout(() => this.flush(), SPAN_BATCH_DELAY_MS).unref();
  }

  flush(): void {
    clearTimeout(this.#timer);
    this.#timer = undefined;
    for (const work of this.#waiting.splice(0)) work();
  }
}

const NONE: readonly never[] = Object.freeze([]);

/** A time a caller passed, in epoch milliseconds. */
function epochMs(time: TimeInput): number {
  const [seconds, nanos] = timeInputToHrTime(time);
  return seconds * 1000 + nanos / 1e6;
}

/** The exception event's attributes, as the SDK's `recordException` makes them. */
function exceptionAttributes(exception: Exception): Attributes {
  if (typeof exception === 'string') return { [ATTR_EXCEPTION_MESSAGE]: exception };
  const type = exception.code?.toString() ?? exception.name;
  return {
    ...(type ? { [ATTR_EXCEPTION_TYPE]: type } : {}),
    ...(exception.message ? { [ATTR_EXCEPTION_MESSAGE]: exception.message } : {}),
    ...(exception.stack ? { [ATTR_EXCEPTION_STACKTRACE]: exception.stack } : {}),
  };
}

class ServerSpan implements Span, ReadableSpan {
  readonly kind = SpanKind.SERVER;
  status: SpanStatus = { code: SpanStatusCode.UNSET };
  #events: TimedEvent[] | undefined;
  #links: Link[] | undefined;
  #endMs = -1;

  readonly #recorder: SpanRecorder;
  readonly #context: SpanContext;
  readonly #startMs: number;

  constructor(
    recorder: SpanRecorder,
    public name: string,
    context: SpanContext,
    readonly parentSpanContext: SpanContext | undefined,
    readonly attributes: Attributes,
    startMs: number,
  ) {
    this.#recorder = recorder;
    this.#context = context;
    this.#startMs = startMs;
  }

  spanContext(): SpanContext {
    return this.#context;
  }

  setAttribute(key: string, value: AttributeValue | undefined): this {
    if (value != null && key !== '' && !this.ended) this.attributes[key] = value;
    return this;
  }

  setAttributes(attributes: Attributes): this {
    for (const [key, value] of Object.entries(attributes)) this.setAttribute(key, value);
    return this;
  }

  addEvent(name: string, attributesOrTime?: Attributes | TimeInput, time?: TimeInput): this {
    if (this.ended) return this;
    const timed = typeof attributesOrTime !== 'object' || Array.isArray(attributesOrTime);
    const at = timed ? (attributesOrTime as TimeInput | undefined) : time;
    const attributes = timed ? {} : { ...(attributesOrTime as Attributes) };
    (this.#events ??= []).push({
      name,
      attributes,
      time: millisToHrTime(at === undefined ? Date.now() : epochMs(at)),
      droppedAttributesCount: 0,
    });
    return this;
  }

  addLink(link: Link): this {
    if (!this.ended) (this.#links ??= []).push(link);
    return this;
  }

  addLinks(links: Link[]): this {
    for (const link of links) this.addLink(link);
    return this;
  }

  /** As the SDK's: UNSET is ignored, and once OK the status stays. */
  setStatus(status: SpanStatus): this {
    if (this.ended || status.code === SpanStatusCode.UNSET) return this;
    if (this.status.code === SpanStatusCode.OK) return this;
    const message = status.code === SpanStatusCode.ERROR ? status.message : undefined;
    this.status = message === undefined ? { code: status.code } : { code: status.code, message };
    return this;
  }

  updateName(name: string): this {
    if (!this.ended) this.name = name;
    return this;
  }

  end(endTime?: TimeInput): void {
    if (this.ended) return;
    this.#endMs = Math.max(this.#startMs, endTime === undefined ? Date.now() : epochMs(endTime));
    this.#recorder.processor.onEnd(this);
  }

  isRecording(): boolean {
    return !this.ended;
  }

  recordException(exception: Exception, time?: TimeInput): void {
    this.addEvent('exception', exceptionAttributes(exception), time);
  }

  get ended(): boolean {
    return this.#endMs >= 0;
  }

  get startTime(): HrTime {
    return millisToHrTime(this.#startMs);
  }

  get endTime(): HrTime {
    return this.ended ? millisToHrTime(this.#endMs) : [0, 0];
  }

  get duration(): HrTime {
    return this.ended ? hrTimeDuration(this.startTime, this.endTime) : [-1, -1];
  }

  get events(): TimedEvent[] {
    return this.#events ?? (NONE as never[]);
  }

  get links(): Link[] {
    return this.#links ?? (NONE as never[]);
  }

  get resource(): Resource {
    return this.#recorder.resource;
  }

  get instrumentationScope(): InstrumentationScope {
    return this.#recorder.scope;
  }

  get droppedAttributesCount(): number {
    return 0;
  }

  get droppedEventsCount(): number {
    return 0;
  }

  get droppedLinksCount(): number {
    return 0;
  }
}

/**
 * Starts a server span under `parent` (the caller's context), sampled by the process's sampler as
 * the SDK's tracer would: a span the sampler drops is a non-recording one that still passes its
 * trace context on. `attributes` becomes the span's own. `startMs` (epoch milliseconds, default
 * now) lets a request's span start when the request did, though it is made later (`request-spans.ts`).
 */
export function startServerSpan(
  recorder: SpanRecorder,
  name: string,
  attributes: Attributes,
  parent: Context,
  startMs = Date.now(),
): Span {
  if (isTracingSuppressed(parent)) return trace.wrapSpanContext(INVALID_SPAN_CONTEXT);
  const parentContext = trace.getSpanContext(parent);
  const valid = parentContext !== undefined && trace.isSpanContextValid(parentContext);
  const traceId = valid ? parentContext.traceId : recorder.ids.generateTraceId();
  const spanId = recorder.ids.generateSpanId();
  const sampled = recorder.sampler.shouldSample(
    parent,
    traceId,
    name,
    SpanKind.SERVER,
    attributes,
    [],
  );
  const context: SpanContext = {
    traceId,
    spanId,
    traceFlags:
      sampled.decision === SamplingDecision.RECORD_AND_SAMPLED
        ? TraceFlags.SAMPLED
        : TraceFlags.NONE,
    traceState: sampled.traceState ?? (valid ? parentContext.traceState : undefined),
  };
  if (sampled.decision === SamplingDecision.NOT_RECORD) return trace.wrapSpanContext(context);
  if (sampled.attributes) Object.assign(attributes, sampled.attributes);
  const span = new ServerSpan(
    recorder,
    name,
    context,
    valid ? parentContext : undefined,
    attributes,
    startMs,
  );
  recorder.processor.onStart(span, parent);
  return span;
}
