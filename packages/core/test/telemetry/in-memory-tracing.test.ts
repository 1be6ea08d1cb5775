/** `InMemoryTracing` (`@ckpt-gym/core/testing`): a trace test's spans, kept in memory. */
import { InMemoryTracing } from '../../src/testing/tracing.js';
import { inSpan, tracingOn } from '../../src/telemetry/tracing.js';

let tracing: InMemoryTracing | undefined;

afterEach(async () => {
  await tracing?.shutdown();
  tracing = undefined;
});

test('in-memory tracing keeps every span that ends, with its parent and trace', async () => {
  tracing = InMemoryTracing.start();
  await inSpan('outer', { attributes: { n: 1 } }, () => inSpan('inner', {}, async () => 'done'));
  await inSpan('elsewhere', {}, async () => undefined);

  const outer = tracing.one('outer', { n: 1 });
  const inner = tracing.one('inner');
  expect(tracing.childrenOf(outer)).toEqual([inner]);
  expect(tracing.parentOf(inner)).toBe(outer);
  expect(
    tracing
      .inTrace(outer)
      .map((span) => span.name)
      .sort(),
  ).toEqual(['inner', 'outer']);
  await tracing.waitForSpans('elsewhere', 1);
  expect(() => tracing!.one('missing')).toThrow(/0 spans missing/);
});

test('in-memory tracing refuses to start while the process traces already, and ends it at shutdown', async () => {
  tracing = InMemoryTracing.start();
  expect(() => InMemoryTracing.start()).toThrow(/traces already/);
  await tracing.shutdown();
  expect(tracingOn()).toBe(false);
  tracing = InMemoryTracing.start();
  expect(tracingOn()).toBe(true);
});
