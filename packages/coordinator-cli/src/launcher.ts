/**
 * The process launcher: every server of a stack file as its own process (and process group), in
 * dependency order, each started as `node <cli> serve --config <runDir>/stack.yaml --server NAME`
 * and waited for on its health route. `up`, `down`, `crash`, the demo and the e2e suite's
 * deployment helper are built on it.
 *
 * The run directory holds `run.json` (names, kinds, pids, ports, URLs, log paths), `stack.yaml`
 * (the resolved copy every process starts from) and `logs/<name>.log`.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import {
  closeSync,
  existsSync,
  mkdirSync,
  openSync,
  readFileSync,
  renameSync,
  writeFileSync,
} from 'node:fs';
import { createServer } from 'node:net';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import { ConfigError, type ServerKind, serverUrl, type StackSettings } from '@ckpt-gym/core';

import { isRunnable } from './serve.js';
import { loadStack, resolvedStackText } from './stack-file.js';

/** The bin every server process runs; the same path from `src/` (tests) and `dist/`. */
export const CLI_MAIN = fileURLToPath(new URL('../dist/main.js', import.meta.url));

/**
 * Node flags of every server process. A young generation of up to 64 MB (V8's default is 16):
 * a commit allocates a burst of short-lived objects (the scope, the export's records, the JSON
 * pieces), and in a server holding thousands of rollouts every scavenge is costly (40–125 ms at
 * 8,000), so fewer of them means a faster commit: at 8,000 rollouts 0.48–0.68 s against
 * 0.65–1.26 s without; 128 MB was slower again, 0.97–1.01 s (the README's Scale section).
 */
export const SERVER_NODE_FLAGS: readonly string[] = ['--max-semi-space-size=64'];

export const RUN_FILE = 'run.json';
export const RESOLVED_STACK_FILE = 'stack.yaml';
export const LAUNCH_ORDER: readonly ServerKind[] = [
  'inference',
  'resources',
  'model',
  'agent',
  'environment',
];
export const HEALTH_TIMEOUT_MS = 30_000;
export const DEFAULT_GRACE_MS = 10_000;

export interface LaunchedServer {
  name: string;
  kind: ServerKind;
  pid: number;
  port: number;
  url: string;
  logPath: string;
}

export interface StackHandle {
  readonly runDir: string;
  /** The resolved stack file every process runs from. */
  readonly configPath: string;
  readonly servers: Map<string, LaunchedServer>;
  /** Spawns the server in its own process group and waits for its health route. */
  startServer(name: string): Promise<LaunchedServer>;
  /** SIGKILLs every gym process group; the inference backend is kept unless `all`. */
  crash(opts?: { all?: boolean }): Promise<void>;
  /** SIGTERM to every group (environment first), SIGKILL to what is left after the grace. */
  stop(opts?: { graceMs?: number }): Promise<void>;
  /** Fresh processes, on the same ports, for every launched server whose process is gone. */
  restart(): Promise<void>;
}

export interface LaunchOptions {
  /** The stack file as written; servers with port 0 get a free port here. */
  configPath: string;
  runDir: string;
  /** Only these servers (default: every server this CLI can run). */
  only?: string[];
  /** The servers' environment (default: this process's): `${VAR}` in the file reads it. */
  env?: NodeJS.ProcessEnv;
  /** Called as each server turns healthy (progress output). */
  onStarted?: (server: LaunchedServer) => void;
}

/** The run file's content. */
interface RunFile {
  config_path: string;
  source_path: string;
  servers: RunFileServer[];
}

/** A launched server as the run file and `--json` output write it. */
export interface RunFileServer {
  name: string;
  kind: ServerKind;
  pid: number;
  port: number;
  url: string;
  log_path: string;
}

/** Raised when a server does not come up; the message holds the end of its log. */
export class LaunchError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'LaunchError';
  }
}

export function serverEntry(s: LaunchedServer): RunFileServer {
  return { name: s.name, kind: s.kind, pid: s.pid, port: s.port, url: s.url, log_path: s.logPath };
}

/** Server ports are chosen from here up to just below the kernel's ephemeral range. */
export const SERVER_PORT_FLOOR = 20000;
const handedOut = new Set<number>();

/** The ports the kernel gives outgoing connections (`ip_local_port_range`). */
function ephemeralPortRange(): [number, number] {
  try {
    const [low, high] = readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8')
      .trim()
      .split(/\s+/)
      .map(Number);
    if (low && high) return [low, high];
  } catch {
    // Not Linux: use the usual range.
  }
  return [32768, 60999];
}

function canBind(port: number, host: string): Promise<boolean> {
  return new Promise((resolveBind) => {
    const probe = createServer();
    probe.unref();
    probe.once('error', () => resolveBind(false));
    probe.listen(port, host, () => probe.close(() => resolveBind(true)));
  });
}

/**
 * A free TCP port on `host` for a server, below the kernel's ephemeral range: a port the kernel
 * picks for port 0 can be taken by an outgoing connection before the server binds it. Never the
 * same port twice in one process.
 */
export async function freePort(host: string): Promise<number> {
  const high = ephemeralPortRange()[0] - 1;
  for (let tries = 0; tries < 500; tries++) {
    const port = SERVER_PORT_FLOOR + Math.floor(Math.random() * (high - SERVER_PORT_FLOOR + 1));
    if (handedOut.has(port) || !(await canBind(port, host))) continue;
    handedOut.add(port);
    return port;
  }
  throw new LaunchError(`no free port between ${SERVER_PORT_FLOOR} and ${high} on ${host}`);
}

/** The servers to run, in dependency order (file order within a kind). */
export function launchOrder(stack: StackSettings, only?: readonly string[]): string[] {
  for (const name of only ?? []) {
    if (!stack.servers.has(name)) {
      throw new ConfigError(`${stack.source}: no server named '${name}'`);
    }
  }
  const servers = [...stack.servers.values()].filter(
    (server) => isRunnable(server) && (only === undefined || only.includes(server.name)),
  );
  return LAUNCH_ORDER.flatMap((kind) =>
    servers.filter((server) => server.kind === kind).map((server) => server.name),
  );
}

/** The route that answers once the server accepts calls (the fake backend has no /health). */
export function healthUrl(kind: ServerKind, url: string): string {
  return kind === 'inference' ? `${url}/v1/models` : `${url}/health`;
}

function isAlive(pgid: number): boolean {
  try {
    process.kill(-pgid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}

function signalGroup(pgid: number, signal: NodeJS.Signals): void {
  try {
    process.kill(-pgid, signal);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ESRCH') throw err;
  }
}

/**
 * Whether the group leader `pid` is still the `serve` process of `name`: a run file can outlive its
 * processes (a reboot), and a pid the system gave to another program must never be signalled.
 * Where /proc is not there to ask, the pid is trusted.
 */
export function isServerProcess(pid: number, name: string): boolean {
  let cmdline: string;
  try {
    cmdline = readFileSync(`/proc/${pid}/cmdline`, 'utf8');
  } catch (err) {
    return (err as NodeJS.ErrnoException).code !== 'ENOENT' || !existsSync('/proc/self');
  }
  const args = cmdline.split('\0');
  return args.includes('serve') && args[args.indexOf('--server') + 1] === name;
}

/** The servers whose process group still runs their `serve` process. */
function liveServers(servers: Iterable<LaunchedServer>): LaunchedServer[] {
  return [...servers].filter((s) => isAlive(s.pid) && isServerProcess(s.pid, s.name));
}

const sleep = (ms: number) => new Promise((done) => setTimeout(done, ms));

/** Waits until none of the groups has a process left; false when `timeoutMs` passed first. */
async function waitGone(pgids: readonly number[], timeoutMs: number): Promise<boolean> {
  const until = Date.now() + timeoutMs;
  for (;;) {
    if (pgids.every((pgid) => !isAlive(pgid))) return true;
    if (Date.now() >= until) return false;
    await sleep(50);
  }
}

function logTail(path: string, lines = 20): string {
  try {
    return readFileSync(path, 'utf8').trimEnd().split('\n').slice(-lines).join('\n');
  } catch {
    return '(no log)';
  }
}

class RunningStack implements StackHandle {
  readonly servers = new Map<string, LaunchedServer>();

  constructor(
    readonly runDir: string,
    readonly configPath: string,
    readonly sourcePath: string,
    readonly stack: StackSettings,
    readonly env: NodeJS.ProcessEnv,
    readonly onStarted?: (server: LaunchedServer) => void,
  ) {}

  async startServer(name: string): Promise<LaunchedServer> {
    const settings = this.stack.servers.get(name);
    if (!settings) throw new ConfigError(`${this.configPath}: no server named '${name}'`);
    const logPath = join(this.runDir, 'logs', `${name}.log`);
    mkdirSync(join(this.runDir, 'logs'), { recursive: true });
    const log = openSync(logPath, 'a');
    let child: ChildProcess;
    try {
      child = spawn(
        process.execPath,
        [...SERVER_NODE_FLAGS, CLI_MAIN, 'serve', '--config', this.configPath, '--server', name],
        { detached: true, stdio: ['ignore', log, log], env: this.env, cwd: this.runDir },
      );
    } finally {
      closeSync(log);
    }
    const pid = child.pid;
    if (pid === undefined) throw new LaunchError(`${name}: could not spawn ${process.execPath}`);
    child.unref();
    let exited: string | undefined;
    child.once('exit', (code, signal) => {
      exited = signal ?? `exit code ${code}`;
    });
    const url = serverUrl(this.stack, name);
    const health = healthUrl(settings.kind, url);
    const until = Date.now() + HEALTH_TIMEOUT_MS;
    for (;;) {
      if (exited !== undefined) {
        throw new LaunchError(
          `${name} exited (${exited}) before it was healthy:\n${logTail(logPath)}`,
        );
      }
      try {
        const reply = await fetch(health, { signal: AbortSignal.timeout(1000) });
        await reply.body?.cancel();
        if (reply.ok) break;
      } catch {
        // Not listening yet.
      }
      if (Date.now() >= until) {
        signalGroup(pid, 'SIGKILL');
        throw new LaunchError(
          `${name} not healthy at ${health} within ${HEALTH_TIMEOUT_MS} ms:\n${logTail(logPath)}`,
        );
      }
      await sleep(50);
    }
    const launched: LaunchedServer = {
      name,
      kind: settings.kind,
      pid,
      port: settings.port,
      url,
      logPath,
    };
    this.servers.set(name, launched);
    this.writeRunFile();
    this.onStarted?.(launched);
    return launched;
  }

  async crash(opts: { all?: boolean } = {}): Promise<void> {
    const victims = liveServers(this.servers.values()).filter(
      (server) => opts.all === true || server.kind !== 'inference',
    );
    for (const server of victims) signalGroup(server.pid, 'SIGKILL');
    await waitGone(
      victims.map((server) => server.pid),
      DEFAULT_GRACE_MS,
    );
  }

  async stop(opts: { graceMs?: number } = {}): Promise<void> {
    // Callers first, so nothing sends work to a server that is already gone.
    const order = liveServers(this.servers.values()).reverse();
    for (const server of order) signalGroup(server.pid, 'SIGTERM');
    const pgids = order.map((server) => server.pid);
    if (!(await waitGone(pgids, opts.graceMs ?? DEFAULT_GRACE_MS))) {
      for (const pgid of pgids) signalGroup(pgid, 'SIGKILL');
      await waitGone(pgids, DEFAULT_GRACE_MS);
    }
  }

  async restart(): Promise<void> {
    const live = new Set(liveServers(this.servers.values()).map((s) => s.name));
    const down = [...this.servers.keys()].filter((name) => !live.has(name));
    await this.startInOrder(launchOrder(this.stack).filter((name) => down.includes(name)));
  }

  /** Kind by kind in launch order; the servers of one kind start side by side. */
  async startInOrder(names: readonly string[]): Promise<void> {
    for (const kind of LAUNCH_ORDER) {
      const level = names.filter((name) => this.stack.servers.get(name)?.kind === kind);
      const started = await Promise.allSettled(level.map((name) => this.startServer(name)));
      const failed = started.find((outcome) => outcome.status === 'rejected');
      if (failed) throw failed.reason;
    }
  }

  writeRunFile(): void {
    const run: RunFile = {
      config_path: this.configPath,
      source_path: this.sourcePath,
      servers: [...this.servers.values()].map(serverEntry),
    };
    const path = join(this.runDir, RUN_FILE);
    writeFileSync(`${path}.tmp`, `${JSON.stringify(run, null, 2)}\n`);
    renameSync(`${path}.tmp`, path);
  }
}

/**
 * Starts every server (or `only` those) in dependency order and writes `<runDir>/run.json`. If one
 * fails to come up, the ones already started are killed and the error is raised.
 */
export async function launchStack(opts: LaunchOptions): Promise<StackHandle> {
  const runDir = resolve(opts.runDir);
  const env = opts.env ?? process.env;
  mkdirSync(runDir, { recursive: true });
  const source = loadStack(opts.configPath, env);
  const names = launchOrder(source, opts.only);
  const ports = new Map<string, number>();
  for (const server of source.servers.values()) {
    if (server.port === 0) ports.set(server.name, await freePort(server.host));
  }
  const configPath = join(runDir, RESOLVED_STACK_FILE);
  writeFileSync(configPath, resolvedStackText(opts.configPath, ports));
  const stack = loadStack(configPath, env);
  const handle = new RunningStack(
    runDir,
    configPath,
    resolve(opts.configPath),
    stack,
    env,
    opts.onStarted,
  );
  try {
    await handle.startInOrder(names);
  } catch (err) {
    await handle.crash({ all: true });
    throw err;
  }
  return handle;
}

/** A handle on a stack another process launched, from its `run.json`. */
export function attachStack(
  runDir: string,
  env: NodeJS.ProcessEnv = process.env,
  onStarted?: (server: LaunchedServer) => void,
): StackHandle {
  const dir = resolve(runDir);
  const path = join(dir, RUN_FILE);
  let run: RunFile;
  try {
    run = JSON.parse(readFileSync(path, 'utf8')) as RunFile;
  } catch (err) {
    throw new LaunchError(
      `no stack runs from ${dir}: cannot read ${path} (${(err as NodeJS.ErrnoException).code ?? (err as Error).message})`,
    );
  }
  const stack = loadStack(run.config_path, env);
  const handle = new RunningStack(dir, run.config_path, run.source_path, stack, env, onStarted);
  for (const s of run.servers) {
    handle.servers.set(s.name, {
      name: s.name,
      kind: s.kind,
      pid: s.pid,
      port: s.port,
      url: s.url,
      logPath: s.log_path,
    });
  }
  return handle;
}

/** Server names whose process group still has a process. */
export function aliveServers(handle: StackHandle): string[] {
  return liveServers(handle.servers.values()).map((s) => s.name);
}
