/**
 * Tracing for tests: this process's real tracer provider, each span exported as it ends into an
 * in-memory exporter, and the look-ups a trace test makes (by name, parent, trace). Server spans
 * end when their response closes, after the client has its reply: wait for them (`waitForSpans`).
 */
import { InMemorySpanExporter, type ReadableSpan } from '@opentelemetry/sdk-trace-base';

import { startTracing, type Tracing, tracingOn } from '../telemetry/tracing.js';

export type { ReadableSpan } from '@opentelemetry/sdk-trace-base';

/** This process's tracing into memory, for a test: `InMemoryTracing.start()`, then `shutdown()`. */
export class InMemoryTracing {
  // A shut down exporter drops what it is given: each tracing has its own.
  readonly #exporter = new InMemorySpanExporter();
  readonly #tracing: Tracing;

  private constructor(serviceName: string, rolloutSampleRatio: number | undefined) {
    this.#tracing = startTracing(
      {
        endpoint: 'http://127.0.0.1:9/unused',
        serviceName,
        ...(rolloutSampleRatio === undefined ? {} : { rolloutSampleRatio }),
      },
      { exporter: this.#exporter },
    );
  }

  /**
   * Turns this process's tracing on into memory; throws if it traces already. Every span is
   * recorded unless `rolloutSampleRatio` samples the request spans (as a stack file's
   * `telemetry.traces.rollout_sample_ratio` does).
   */
  static start(
    serviceName = 'test',
    options: { readonly rolloutSampleRatio?: number } = {},
  ): InMemoryTracing {
    if (tracingOn()) throw new Error('this process traces already: shut that tracing down first');
    return new InMemoryTracing(serviceName, options.rolloutSampleRatio);
  }

  /** Every span that has ended, in the order they ended. */
  spans(): ReadableSpan[] {
    return this.#exporter.getFinishedSpans();
  }

  /** The finished spans named `name`. */
  named(name: string): ReadableSpan[] {
    return this.spans().filter((span) => span.name === name);
  }

  /** The one finished span named `name` whose attributes include `attributes`. */
  one(name: string, attributes: Record<string, unknown> = {}): ReadableSpan {
    const found = this.named(name).filter((span) =>
      Object.entries(attributes).every(([key, value]) => span.attributes[key] === value),
    );
    if (found.length !== 1) {
      const all = this.spans().map((s) => `${s.name} ${JSON.stringify(s.attributes)}`);
      throw new Error(
        `${found.length} spans ${name} ${JSON.stringify(attributes)}; have:\n${all.join('\n')}`,
      );
    }
    return found[0]!;
  }

  /** The finished spans whose parent is `parent`. */
  childrenOf(parent: ReadableSpan): ReadableSpan[] {
    const id = parent.spanContext().spanId;
    return this.spans().filter((span) => span.parentSpanContext?.spanId === id);
  }

  /** `span`'s parent, if it has ended. */
  parentOf(span: ReadableSpan): ReadableSpan | undefined {
    const id = span.parentSpanContext?.spanId;
    return this.spans().find((s) => s.spanContext().spanId === id);
  }

  /** The finished spans of `root`'s trace. */
  inTrace(root: ReadableSpan): ReadableSpan[] {
    const id = root.spanContext().traceId;
    return this.spans().filter((span) => span.spanContext().traceId === id);
  }

  /** Polls until `count` spans named `name` have ended. */
  async waitForSpans(name: string, count: number, timeoutMs = 10_000): Promise<void> {
    const until = Date.now() + timeoutMs;
    while (this.named(name).length < count) {
      if (Date.now() > until) {
        throw new Error(`${this.named(name).length}/${count} spans ${name} ended`);
      }
      await new Promise((resolve) => setTimeout(resolve, 10));
    }
  }

  /** Ends this process's tracing (and drops the spans it kept: read them before). */
  shutdown(): Promise<void> {
    return this.#tracing.shutdown();
  }
}
