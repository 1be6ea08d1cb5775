/**
 * The CLI's traces. `serve` traces as its server (service name and instance: the server's name);
 * a command that drives a checkpoint traces as `ckpt-gym`, the whole command one root span, so
 * `ckpt-gym checkpoint` (prepare, commit, publish, resume) is one trace across every process.
 * Other commands (`up`, `run`…) do not trace here: the servers they start trace themselves.
 */
import { inSpan, startTracingFor } from '@ckpt-gym/core/client';
import type { StackSettings } from '@ckpt-gym/core/server';

import type { Invocation } from './args.js';
import { CHECKPOINT_COMMANDS } from './context.js';

export const CLI_SERVICE_NAME = 'ckpt-gym';

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
  if (!CHECKPOINT_COMMANDS.has(invocation.command)) return command();
  const tracing = startTracingFor(
    { service: CLI_SERVICE_NAME, instance: CLI_SERVICE_NAME },
    stack.telemetry,
    env,
  );
  if (tracing === undefined) return command();
  return inSpan(`${CLI_SERVICE_NAME} ${invocation.command}`, {}, command);
}
