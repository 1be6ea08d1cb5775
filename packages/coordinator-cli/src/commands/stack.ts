/** `serve`, `up`, `down`, `crash`: running the servers of a stack as processes. */
import { existsSync, rmSync } from 'node:fs';
import { join, resolve } from 'node:path';

import { DEFAULT_RUN_DIR, PROGRAM } from '../args.js';
import { CliFailure, type CommandContext, describe } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import {
  aliveServers,
  attachStack,
  LaunchError,
  launchStack,
  type LaunchedServer,
  RUN_FILE,
  serverEntry,
  type StackHandle,
} from '../launcher.js';
import { type CommandResult, table } from '../output.js';
import { serveProcess } from '../serve.js';

/** `received` resolves once SIGTERM or SIGINT arrives; the handlers go then, or on `cancel`. */
export function untilSignal(): { received: Promise<NodeJS.Signals>; cancel(): void } {
  let on: (signal: NodeJS.Signals) => void = () => undefined;
  // Signal handlers do not keep node running: a foreground `up` whose children are detached would
  // otherwise end (exit 13, an unsettled top-level await) instead of waiting.
  const keepAlive = setInterval(() => undefined, 2 ** 30);
  const cancel = () => {
    clearInterval(keepAlive);
    process.off('SIGTERM', on);
    process.off('SIGINT', on);
  };
  const received = new Promise<NodeJS.Signals>((done) => {
    on = (signal) => {
      cancel();
      done(signal);
    };
  });
  process.on('SIGTERM', on);
  process.on('SIGINT', on);
  return { received, cancel };
}

export function runDirOf(ctx: CommandContext): string {
  return resolve(ctx.io.cwd, ctx.invocation.runDir ?? DEFAULT_RUN_DIR);
}

function serverTable(servers: Iterable<LaunchedServer>): string {
  return table(
    ['SERVER', 'KIND', 'PID', 'URL', 'LOG'],
    [...servers].map((s) => [s.name, s.kind, String(s.pid), s.url, s.logPath]),
  );
}

export async function serveCommand(ctx: CommandContext): Promise<CommandResult> {
  const name = ctx.invocation.server ?? '';
  const signal = untilSignal();
  // With --json, stdout holds only the closing document; the line goes with the progress.
  const out = ctx.invocation.json ? ctx.io.stderr : ctx.io.stdout;
  let running;
  try {
    running = await serveProcess(ctx.stack, name, (line) => out.write(`${line}\n`));
  } catch (err) {
    signal.cancel();
    throw err;
  }
  const received = await signal.received;
  // From here on the process is ending: a later signal (a worker gets the terminal's SIGINT and
  // then its primary's SIGTERM) must not turn its clean stop into a kill, during the close or
  // while it exits.
  const ignore = (): void => undefined;
  process.on('SIGTERM', ignore).on('SIGINT', ignore);
  await running.close();
  return {
    exitCode: ExitCode.OK,
    data: { server: name, signal: received },
    text: JSON.stringify({ event: 'stopped', server: name, signal: received }),
  };
}

function attach(ctx: CommandContext, onStarted?: (s: LaunchedServer) => void): StackHandle {
  try {
    return attachStack(runDirOf(ctx), { ...ctx.io.env }, onStarted);
  } catch (err) {
    throw new CliFailure(describe(err));
  }
}

export async function upCommand(ctx: CommandContext): Promise<CommandResult> {
  const runDir = runDirOf(ctx);
  const started = (s: LaunchedServer) => ctx.progress(`${s.name} (${s.kind}): up at ${s.url}`);
  // Installed first: a Ctrl-C during start-up stops what was started once it is up.
  const signal = ctx.invocation.detach ? undefined : untilSignal();
  let handle: StackHandle;
  let restarted = false;
  try {
    ({ handle, restarted } = await startStack(ctx, runDir, started));
  } catch (err) {
    signal?.cancel();
    throw err;
  }
  const summary = [
    serverTable(handle.servers.values()),
    '',
    `${restarted ? 'restarted the servers that were down' : 'stack up'}; ` +
      `run file ${join(runDir, RUN_FILE)}; use --config ${handle.configPath} for the other commands`,
  ].join('\n');
  const data = {
    run_dir: runDir,
    config_path: handle.configPath,
    servers: [...handle.servers.values()].map(serverEntry),
  };
  if (signal === undefined) return { exitCode: ExitCode.OK, data, text: summary };

  ctx.progress(`${summary}\nCtrl-C stops the stack`);
  ctx.progress(`${await signal.received}: stopping`);
  await handle.stop({ graceMs: ctx.invocation.graceSeconds * 1000 });
  rmSync(join(runDir, RUN_FILE), { force: true });
  return { exitCode: ExitCode.OK, data: { ...data, stopped: true }, text: 'stack stopped' };
}

/** A new stack, or (a run file exists) the servers of the known one that are down. */
async function startStack(
  ctx: CommandContext,
  runDir: string,
  started: (s: LaunchedServer) => void,
): Promise<{ handle: StackHandle; restarted: boolean }> {
  if (existsSync(join(runDir, RUN_FILE))) {
    const handle = attach(ctx, started);
    if (aliveServers(handle).length === handle.servers.size) {
      throw new CliFailure(
        `the stack of ${runDir} is already running (${PROGRAM} down --run-dir ${runDir} first)`,
      );
    }
    await handle.restart().catch((err: unknown) => {
      throw upFailure(err);
    });
    return { handle, restarted: true };
  }
  try {
    const handle = await launchStack({
      configPath: ctx.configPath,
      runDir,
      env: { ...ctx.io.env },
      onStarted: started,
    });
    return { handle, restarted: false };
  } catch (err) {
    throw upFailure(err);
  }
}

/**
 * `up`'s failure: each server that did not come up is named with its address and reason (the
 * failure table, and `failed` in the JSON), e.g. a port another stack holds.
 */
function upFailure(err: unknown): CliFailure {
  if (!(err instanceof LaunchError) || err.failures.length === 0) {
    return new CliFailure(describe(err));
  }
  const failures = Object.fromEntries(
    err.failures.map((f) => [f.server, `${f.host}:${f.port}: ${f.reason}`]),
  );
  return new CliFailure(err.message, failures, ExitCode.FAILURE, { failed: err.failures });
}

export async function downCommand(ctx: CommandContext): Promise<CommandResult> {
  const runDir = runDirOf(ctx);
  if (!existsSync(join(runDir, RUN_FILE))) return nothingTo('stop', runDir);
  const handle = attach(ctx);
  const running = aliveServers(handle);
  if (running.length > 0) {
    ctx.progress(`stopping ${running.length} server(s) (grace ${ctx.invocation.graceSeconds} s) …`);
  }
  await handle.stop({ graceMs: ctx.invocation.graceSeconds * 1000 });
  rmSync(join(runDir, RUN_FILE), { force: true });
  if (running.length === 0) return nothingTo('stop', runDir);
  return {
    exitCode: ExitCode.OK,
    data: { run_dir: runDir, stopped: running, nothing_to_stop: false },
    text: `stopped ${running.join(', ')}`,
  };
}

export async function crashCommand(ctx: CommandContext): Promise<CommandResult> {
  const runDir = runDirOf(ctx);
  if (!existsSync(join(runDir, RUN_FILE))) return nothingTo('kill', runDir);
  const handle = attach(ctx);
  const all = ctx.invocation.all;
  const running = new Set(aliveServers(handle));
  const killed = [...handle.servers.values()]
    .filter((s) => running.has(s.name) && (all || s.kind !== 'inference'))
    .map((s) => s.name);
  if (killed.length === 0) return nothingTo('kill', runDir);
  await handle.crash({ all });
  return {
    exitCode: ExitCode.OK,
    data: { run_dir: runDir, killed, nothing_to_kill: false },
    text:
      `SIGKILLed ${killed.join(', ')}` +
      (all ? '' : '; the inference backend is kept') +
      `\nstart fresh processes with: ${PROGRAM} up --run-dir ${runDir}`,
  };
}

/**
 * `down` or `crash` with no server of the stack running succeeds: the stack is down either way,
 * as after `docker compose down`, so a cleanup script (`trap … EXIT`) can run it unconditionally.
 */
function nothingTo(what: 'stop' | 'kill', runDir: string): CommandResult {
  const list = what === 'stop' ? 'stopped' : 'killed';
  return {
    exitCode: ExitCode.OK,
    data: { run_dir: runDir, [list]: [], [`nothing_to_${what}`]: true },
    text: `nothing to ${what}: no server of the stack of ${runDir} is running`,
  };
}
