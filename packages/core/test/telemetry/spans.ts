/**
 * Tracing for a test file: the real SDK, each span exported as it ends into an
 * `InMemorySpanExporter`, started before each test and shut down after it; helpers to find spans
 * and wait for them (server spans end when their response closes, after the client has its reply).
 */
import { InMemorySpanExporter, type ReadableSpan } from '@opentelemetry/sdk-trace-base';

import { startTracing, type Tracing } from '../../src/telemetry/tracing.js';

// A shut down exporter drops what it is given: each test gets its own.
let exporter = new InMemorySpanExporter();
let tracing: Tracing | undefined;

export function useInMemoryTracing(serviceName = 'unit'): void {
  beforeEach(() => {
    exporter = new InMemorySpanExporter();
    tracing = startTracing({ endpoint: 'http://127.0.0.1:9/unused', serviceName }, { exporter });
  });
  afterEach(async () => {
    await tracing?.shutdown();
    tracing = undefined;
  });
}

export function spans(): ReadableSpan[] {
  return exporter.getFinishedSpans();
}

export function named(name: string): ReadableSpan[] {
  return spans().filter((span) => span.name === name);
}

/** The one finished span named `name` whose attributes include `attributes`. */
export function one(name: string, attributes: Record<string, unknown> = {}): ReadableSpan {
  const found = named(name).filter((span) =>
    Object.entries(attributes).every(([key, value]) => span.attributes[key] === value),
  );
  if (found.length !== 1) {
    const all = spans().map((s) => `${s.name} ${JSON.stringify(s.attributes)}`);
    throw new Error(
      `${found.length} spans ${name} ${JSON.stringify(attributes)}; have:\n${all.join('\n')}`,
    );
  }
  return found[0] as ReadableSpan;
}

export function childrenOf(parent: ReadableSpan): ReadableSpan[] {
  const id = parent.spanContext().spanId;
  return spans().filter((span) => span.parentSpanContext?.spanId === id);
}

export function parentOf(span: ReadableSpan): ReadableSpan | undefined {
  const id = span.parentSpanContext?.spanId;
  return spans().find((s) => s.spanContext().spanId === id);
}

export function traceId(span: ReadableSpan): string {
  return span.spanContext().traceId;
}

/** Polls until `count` spans named `name` have ended. */
export async function waitForSpans(name: string, count: number, timeoutMs = 10_000): Promise<void> {
  const until = Date.now() + timeoutMs;
  while (named(name).length < count) {
    if (Date.now() > until) throw new Error(`${named(name).length}/${count} spans ${name} ended`);
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}
