/** A span recorder for tests of request spans: an in-memory exporter behind a simple processor. */
import { resourceFromAttributes } from '@opentelemetry/resources';
import {
  AlwaysOnSampler,
  InMemorySpanExporter,
  ParentBasedSampler,
  RandomIdGenerator,
  type Sampler,
  SimpleSpanProcessor,
} from '@opentelemetry/sdk-trace-base';

import { SpanBatch, type SpanRecorder } from '../../src/telemetry/server-span.js';

export function recorderWith(sampler: Sampler = new AlwaysOnSampler()) {
  const exporter = new InMemorySpanExporter();
  const recorder: SpanRecorder = {
    resource: resourceFromAttributes({ 'service.name': 'unit' }),
    scope: { name: 'ckpt-gym', version: undefined, schemaUrl: undefined },
    sampler,
    followsParent: sampler instanceof ParentBasedSampler,
    processor: new SimpleSpanProcessor(exporter),
    ids: new RandomIdGenerator(),
    batch: new SpanBatch(),
  };
  return { recorder, exported: () => exporter.getFinishedSpans() };
}
