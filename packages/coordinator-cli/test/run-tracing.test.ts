/**
 * `ckpt-gym run` traced in the CLI process: each checkpoint the collection takes is its own trace,
 * a `ckpt-gym checkpoint` root with the controller's operations and stages under it, against real
 * in-process servers, the spans kept by core's `InMemoryTracing`.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { inSpan, stopTracing, tracingOn } from '@ckpt-gym/core/client';
import { ATTR_CHECKPOINT_ID, type StackSettings } from '@ckpt-gym/core/server';
import { InMemoryTracing, type ReadableSpan } from '@ckpt-gym/core/testing';
import { trace } from '@opentelemetry/api';

import type { Invocation } from '../src/args.js';
import { parseCommandLine } from '../src/args.js';
import { Collector } from '../src/collect.js';
import { CollectionDir } from '../src/collection/files.js';
import { CollectionCheckpoints } from '../src/commands/run-checkpoints.js';
import { CommandContext } from '../src/context.js';
import { tracedCommand } from '../src/tracing.js';
import { startStack, type TestStack, TOKEN_ENV } from './support/stack.js';

let dir: string;
let stack: TestStack;

beforeEach(async () => {
  dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-run-tracing-'));
  stack = await startStack(dir);
});

afterEach(async () => {
  await stopTracing();
  await stack.close();
  rmSync(dir, { recursive: true, force: true });
});

function contextOf(args: string[]): CommandContext {
  const parsed = parseCommandLine([...args, '--config', stack.file]);
  if (parsed.kind !== 'invoke') throw new Error(`bad command line ${args.join(' ')}`);
  const silent = { write: () => undefined };
  return new CommandContext(parsed.invocation, {
    stdout: silent,
    stderr: silent,
    env: { [TOKEN_ENV]: 'test-token' },
    cwd: dir,
  });
}

const childNames = (tracing: InMemoryTracing, parent: ReadableSpan) =>
  tracing
    .childrenOf(parent)
    .map((span) => span.name)
    .sort();

test('each checkpoint a collection takes is its own trace: a ckpt-gym checkpoint root over the controller’s stages', async () => {
  const tracing = InMemoryTracing.start('ckpt-gym');
  const ctx = contextOf(['status']);
  const collector = new Collector({
    envUrl: 'http://127.0.0.1:9',
    concurrency: 1,
    client: ctx.clients.data,
    onResult: () => undefined,
  });
  const checkpoints = new CollectionCheckpoints(
    ctx,
    new CollectionDir(dir),
    { run_id: 'run-a', leg: 0 },
    collector,
  );
  try {
    // Taken while another span is active (a signal can fire anywhere): still a root.
    await inSpan('unrelated', {}, async () => checkpoints.take(false));
    checkpoints.take(false);
    await checkpoints.settled();
  } finally {
    ctx.close();
  }
  expect(checkpoints.published).toHaveLength(2);

  const roots = tracing.named('ckpt-gym checkpoint');
  expect(roots.map((root) => root.attributes[ATTR_CHECKPOINT_ID])).toEqual(checkpoints.published);
  for (const root of roots) expect(root.parentSpanContext).toBeUndefined();
  expect(new Set(roots.map((root) => root.spanContext().traceId)).size).toBe(2);

  for (const root of roots) {
    expect(childNames(tracing, root)).toEqual([
      'gym.checkpoint.coordinate.commit',
      'gym.checkpoint.coordinate.prepare',
      'gym.checkpoint.coordinate.resume',
    ]);
    const inTrace = tracing.inTrace(root);
    const prepare = inTrace.find((span) => span.name === 'gym.checkpoint.coordinate.prepare');
    expect(childNames(tracing, prepare!)).toEqual([
      'gym.checkpoint.coordinate.prepare.environment',
      'gym.checkpoint.coordinate.prepare.model',
      'gym.checkpoint.coordinate.prepare.resources',
    ]);
    // Every participant's prepare joined this checkpoint's trace, and no other.
    const participants = inTrace.filter((span) => span.name === 'gym.checkpoint.prepare');
    expect(participants).toHaveLength(3);
  }
});

test('run turns the CLI’s tracing on and opens no span of its own (its checkpoints are the roots)', async () => {
  const invocation = { command: 'run' } as Invocation;
  const stackSettings = { telemetry: undefined } as unknown as StackSettings;
  const env = { OTEL_EXPORTER_OTLP_ENDPOINT: 'http://127.0.0.1:9' };
  const seen = await tracedCommand(invocation, stackSettings, env, async () => ({
    on: tracingOn(),
    active: trace.getActiveSpan(),
  }));
  expect(seen).toEqual({ on: true, active: undefined });
});
