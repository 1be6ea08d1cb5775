/**
 * Tracing for a test file: core's `InMemoryTracing` started before each test and shut down after
 * it, its look-ups as plain functions of the current test's tracing.
 */
import type { ReadableSpan } from '@opentelemetry/sdk-trace-base';

import { InMemoryTracing } from '../../src/testing/tracing.js';

let tracing: InMemoryTracing | undefined;

function current(): InMemoryTracing {
  if (!tracing) throw new Error('useInMemoryTracing() was not called in this file');
  return tracing;
}

/** The request spans' sample ratio of the describe block running (`sampleRolloutsAt`). */
let rolloutSampleRatio: number | undefined;

export function useInMemoryTracing(serviceName = 'unit'): void {
  beforeEach(() => {
    tracing = InMemoryTracing.start(
      serviceName,
      rolloutSampleRatio === undefined ? {} : { rolloutSampleRatio },
    );
  });
  afterEach(async () => {
    await tracing?.shutdown();
    tracing = undefined;
  });
}

export const spans = (): ReadableSpan[] => current().spans();
export const named = (name: string): ReadableSpan[] => current().named(name);
export const one = (name: string, attributes: Record<string, unknown> = {}): ReadableSpan =>
  current().one(name, attributes);
export const childrenOf = (parent: ReadableSpan): ReadableSpan[] => current().childrenOf(parent);
export const parentOf = (span: ReadableSpan): ReadableSpan | undefined => current().parentOf(span);
export const traceId = (span: ReadableSpan): string => span.spanContext().traceId;
export const waitForSpans = (name: string, count: number, timeoutMs?: number): Promise<void> =>
  current().waitForSpans(name, count, timeoutMs);

/**
 * In the calling describe block, tracing samples the request spans at `ratio`, as a stack file's
 * `telemetry.traces.rollout_sample_ratio` does (elsewhere every span is recorded).
 */
export function sampleRolloutsAt(ratio: number): void {
  beforeAll(() => {
    rolloutSampleRatio = ratio;
  });
  afterAll(() => {
    rolloutSampleRatio = undefined;
  });
}
