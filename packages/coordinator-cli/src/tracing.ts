/**
 * The CLI's traces. `serve` traces as its server (service name and instance: the server's name);
 * a command that drives a checkpoint traces as `ckpt-gym`, the whole command one root span, so
 * `ckpt-gym checkpoint` (prepare, commit, publish, resume) is one trace across every process.
 * `run` traces its checkpoints, each its own root (`CHECKPOINT_SPAN`, see `run-checkpoints.ts`), not
 * the whole run: a collection lasts hours and one trace per checkpoint is what a viewer can show.
 * Other commands (`up`…) do not trace here: the servers they start trace themselves.
 */
import { inSpan, startTracingFor } from '@ckpt-gym/core/client';
import type { StackSettings } from '@ckpt-gym/core/server';

import type { Invocation } from './args.js';
import { CHECKPOINT_COMMANDS } from './context.js';

export const CLI_SERVICE_NAME = 'ckpt-gym';
/** The root span of each checkpoint a collection takes, as `ckpt-gym checkpoint` names its own. */
export const CHECKPOINT_SPAN = `${CLI_SERVICE_NAME} checkpoint`;
/** Commands that trace with no span of their own: they make their roots as they go. */
const ROOTS_AS_THEY_GO: ReadonlySet<string> = new Set(['run']);

function startCliTracing(stack: StackSettings, env: NodeJS.ProcessEnv) {
  return startTracingFor(
    { service: CLI_SERVICE_NAME, instance: CLI_SERVICE_NAME },
    stack.telemetry,
    env,
  );
}

/**
 * Runs the command with tracing on when the stack file or `OTEL_*` variables ask for it; the
 * caller ends it (`stopTracing`) once the command returned.
 */
export function tracedCommand<T>(
  invocation: Invocation,
  stack: StackSettings,
  env: NodeJS.ProcessEnv,
  command: () => Promise<T>,
): Promise<T> {
  if (invocation.command === 'serve' && invocation.server !== undefined) {
    const name = invocation.server;
    startTracingFor({ service: name, instance: name }, stack.telemetry, env);
    return command();
  }
  if (ROOTS_AS_THEY_GO.has(invocation.command)) {
    startCliTracing(stack, env);
    return command();
  }
  if (!CHECKPOINT_COMMANDS.has(invocation.command)) return command();
  if (startCliTracing(stack, env) === undefined) return command();
  return inSpan(`${CLI_SERVICE_NAME} ${invocation.command}`, {}, command);
}
