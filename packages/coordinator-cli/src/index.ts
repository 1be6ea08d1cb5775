/**
 * @ckpt-gym/coordinator-cli: the `ckpt-gym` command. `runCli` runs one command line in-process
 * and resolves with its exit code; the bin (main.ts) is a thin wrapper around it.
 */
import { CoordinationError, stopTracing } from '@ckpt-gym/core/client';
import { CkptGymError } from '@ckpt-gym/core/protocol';

import { type Invocation, parseCommandLine, PROGRAM } from './args.js';
import { HANDLERS } from './commands/index.js';
import { CliFailure, type CliIo, CommandContext, describe } from './context.js';
import { ExitCode } from './exit-codes.js';
import { failureTable, jsonDocument } from './output.js';
import { tracedCommand } from './tracing.js';
import { packageVersion } from './version.js';

export {
  COMMANDS,
  type CommandName,
  type Invocation,
  parseCommandLine,
  type ParseOutcome,
} from './args.js';
export {
  BUNDLED_EXAMPLE,
  CliFailure,
  type CliIo,
  resolveConfigPath,
  type Sink,
} from './context.js';
export { ExitCode, type ExitCodeValue } from './exit-codes.js';
export type { CommandResult } from './output.js';
export { CONTROLLER_FILE, type ControllerRecord } from './publication.js';
export { episodesInFlight, EPISODES_FIELD, RESTORED_PENDING_FIELD } from './scope.js';
export {
  aliveServers,
  attachStack,
  CLI_MAIN,
  freePort,
  healthUrl,
  isServerProcess,
  LaunchError,
  type LaunchedServer,
  launchOrder,
  launchStack,
  type LaunchOptions,
  parentPid,
  RESOLVED_STACK_FILE,
  RUN_FILE,
  SERVER_GLIBC_TUNABLE,
  SERVER_NODE_FLAGS,
  type StackHandle,
} from './launcher.js';
export {
  isRunnable,
  KIND_SCHEMAS,
  SERVER_KIND_MODULES,
  serveServer,
  type ServingServer,
} from './serve.js';
export { loadStack, resolvedStackText, RUN_CAPTURE_DIR, SOURCE_KEY } from './stack-file.js';
export {
  Collector,
  type CollectorOptions,
  type Dispatch,
  inputTasks,
  type InputTask,
  parseTasks,
  type ResultRow,
  type TaskSpec,
  weatherTask,
} from './collect.js';
export {
  CollectionDir,
  DISPATCH_LOG,
  LATEST_FILE,
  MANIFEST_FILE,
  PID_FILE,
  processAlive,
} from './collection/files.js';
export { failuresPathFor } from './collection/nemo.js';
export { type CollectionManifest } from './collection/resume.js';
export { type DemoReport, demoStackText, repeatedCalls, runDemo } from './demo.js';

/** Runs one command line; every output goes to `io` (defaults: the process's). */
export async function runCli(argv: readonly string[], io: Partial<CliIo> = {}): Promise<number> {
  const full: CliIo = {
    stdout: io.stdout ?? process.stdout,
    stderr: io.stderr ?? process.stderr,
    env: io.env ?? process.env,
    cwd: io.cwd ?? process.cwd(),
  };
  const parsed = parseCommandLine(argv);
  switch (parsed.kind) {
    case 'help':
      full.stdout.write(`${parsed.text}\n`);
      return ExitCode.OK;
    case 'version': {
      const version = packageVersion();
      full.stdout.write(
        parsed.json ? jsonDocument('version', ExitCode.OK, { version }) : `${version}\n`,
      );
      return ExitCode.OK;
    }
    case 'usage-error':
      full.stderr.write(`${PROGRAM}: ${parsed.message}\n\n${parsed.usage}\n`);
      if (parsed.json) {
        full.stdout.write(
          jsonDocument('usage', ExitCode.USAGE, { error: { message: parsed.message } }),
        );
      }
      return ExitCode.USAGE;
    case 'invoke':
      return run(parsed.invocation, full);
  }
}

async function run(invocation: Invocation, io: CliIo): Promise<number> {
  let ctx: CommandContext | undefined;
  try {
    const context = new CommandContext(invocation, io);
    ctx = context;
    const handler = HANDLERS[invocation.command];
    const result = await tracedCommand(invocation, ctx.stack, io.env, () => handler(context));
    if (result.streamed === true) return result.exitCode;
    if (invocation.json)
      io.stdout.write(jsonDocument(invocation.command, result.exitCode, result.data));
    else io.stdout.write(`${result.text}\n`);
    return result.exitCode;
  } catch (err) {
    const failure = asFailure(err);
    if (invocation.json) {
      io.stdout.write(
        jsonDocument(invocation.command, failure.exitCode, {
          ...failure.data,
          error: { message: failure.message, failures: failure.failures },
        }),
      );
    } else {
      const failures =
        Object.keys(failure.failures).length > 0 ? `\n${failureTable(failure.failures)}` : '';
      io.stderr.write(`${PROGRAM} ${invocation.command}: ${failure.message}${failures}\n`);
    }
    return failure.exitCode;
  } finally {
    ctx?.close();
    await stopTracing();
  }
}

/** Every error as a failure: coordination failures keep their per-server list. */
function asFailure(err: unknown): CliFailure {
  if (err instanceof CliFailure) return err;
  if (err instanceof CoordinationError) {
    return new CliFailure(
      `${err.operation} failed on ${Object.keys(err.failures).length} participant(s)`,
      err.failures,
    );
  }
  if (err instanceof CkptGymError) return new CliFailure(err.message);
  return new CliFailure(`unexpected error: ${describe(err)}`);
}
