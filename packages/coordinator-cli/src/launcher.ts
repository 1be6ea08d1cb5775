/**
 * The process launcher: every server of a stack file as its own process (and process group), in
 * dependency order, each started as `node <cli> serve --config <runDir>/stack.yaml --server NAME`
 * and waited for on its health route. A server with `num_workers: N` is its primary process and
 * the N workers it forks, all in its group. `up`, `down`, `crash`, the demo and the e2e suite's
 * deployment helper are built on it.
 *
 * The run directory holds `run.json` (names, kinds, pids, ports, URLs, log paths), `stack.yaml`
 * (the resolved copy every process starts from) and `logs/<name>.log`.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import {
  closeSync,
  existsSync,
  fstatSync,
  mkdirSync,
  openSync,
  readFileSync,
  renameSync,
  writeFileSync,
} from 'node:fs';
import { createServer } from 'node:net';
import { join, resolve } from 'node:path';
import { setTimeout as delay } from 'node:timers/promises';
import { fileURLToPath } from 'node:url';

import { ConfigError } from '@ckpt-gym/core/protocol';
import {
  type HealthReply,
  LAUNCH_ID_ENV,
  type ServerKind,
  serverUrl,
  type StackSettings,
} from '@ckpt-gym/core/server';

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
 * An old generation of 128 MB before the first full collection: a restored server is always a
 * fresh process, whose restore grows its heap from a few MB to tens of MB of decoded records, and
 * V8's small initial limit ran a full collection over those records on the way. Reading the
 * 8,000-rollout checkpoint in a fresh process: no full collection instead of one, environment
 * 107–109 ms of CPU against 118–124, agent 202–271 against 220–277; start-up unchanged.
 */
export const SERVER_NODE_FLAGS: readonly string[] = [
  '--max-semi-space-size=64',
  '--initial-old-space-size=128',
];

/** The huge-page tunable's name: a user who sets it in their own `GLIBC_TUNABLES` keeps their value. */
const HUGETLB_TUNABLE = 'glibc.malloc.hugetlb';

/**
 * glibc's malloc on transparent huge pages (glibc 2.35 and later; older ones ignore it, and where
 * huge pages are off it changes nothing): buffers' memory then comes in 2 MB pages instead of
 * 4 KB ones. A checkpoint touches tens of MB of memory a process never touched before (a
 * coordinator's workers' frames, the records written), and on a VM each first touch of a page is
 * costly. A two-worker policy model's commit at 8,000 rollouts: the primary's page faults 11,800–
 * 13,100 → 7,000–8,000, a worker's 1,400–4,500 → 230–960, the commit 0.62/0.69/0.71 →
 * 0.53/0.60/0.88 s (three alternating pairs; the 0.88 run had a worker's full collection in it).
 * Resident memory unchanged.
 */
export const SERVER_GLIBC_TUNABLE = `${HUGETLB_TUNABLE}=1`;

/**
 * A server process's environment: `env`, with `SERVER_GLIBC_TUNABLE` added to its
 * `GLIBC_TUNABLES` (colon-separated) unless they set that tunable themselves.
 */
export function serverEnv(env: NodeJS.ProcessEnv): NodeJS.ProcessEnv {
  const tunables = env.GLIBC_TUNABLES ?? '';
  if (tunables.split(':').some((tunable) => tunable.startsWith(`${HUGETLB_TUNABLE}=`))) {
    return env;
  }
  const GLIBC_TUNABLES =
    tunables === '' ? SERVER_GLIBC_TUNABLE : `${tunables}:${SERVER_GLIBC_TUNABLE}`;
  return { ...env, GLIBC_TUNABLES };
}

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
  /**
   * SIGTERM to every group (environment first), SIGKILL to what is left after the grace. A
   * server's workers share its group: each stops on its own signal, as its primary asks too.
   */
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

/** A server that did not come up, as `up --json` reports it. */
export interface LaunchFailure {
  readonly server: string;
  readonly host: string;
  readonly port: number;
  /** The listen error its log gives (EADDRINUSE, …), else how it exited, else the timeout. */
  readonly reason: string;
  /** Who answered the port's health route instead, when another process did. */
  readonly answered_by?: string;
}

/** Raised when a server does not come up; the message holds the end of its log. */
export class LaunchError extends Error {
  constructor(
    message: string,
    /** The servers that did not come up, each with its port (none for a failure before any). */
    readonly failures: readonly LaunchFailure[] = [],
  ) {
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

export const HEALTH_ROUTE = '/health';

/** A server's health route: every gym server and the fake backend answer it (compose probes it). */
export function healthUrl(url: string): string {
  return `${url}${HEALTH_ROUTE}`;
}

/**
 * A launched child, as its health reply must name it. A 200 alone proves nothing: the route is
 * answered by whatever listens on the port, and with another stack on the same ports every new
 * server died with EADDRINUSE while the old ones answered, so `up` said `stack up`. Each child gets
 * a nonce of its own launch (LAUNCH_ID_ENV), which no older process can echo (a pid can be reused),
 * and its pid, which is what the run file records and `down` signals. The reply must carry both.
 */
export interface LaunchedChild {
  readonly pid: number;
  readonly launchId: string;
}

/** The parent of process `pid`, from /proc (Linux); undefined when it cannot be read. */
export function parentPid(pid: number): number | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    // `pid (comm) state ppid …`; comm may itself hold ') '.
    const ppid = Number(stat.slice(stat.lastIndexOf(') ') + 2).split(' ')[1]);
    return Number.isSafeInteger(ppid) ? ppid : undefined;
  } catch {
    return undefined;
  }
}

/**
 * Whether a `/health` reply body comes from `child` itself, or from one of its workers: a server
 * with several workers answers from a worker, a process the child forked (which inherits the
 * nonce), so its pid is the worker's and its parent is the child.
 */
export function provesLaunchedChild(
  body: unknown,
  child: LaunchedChild,
  parentOf: (pid: number) => number | undefined = parentPid,
): boolean {
  const reply = body as Partial<HealthReply> | null;
  return (
    typeof reply === 'object' &&
    reply !== null &&
    reply.status === 'ok' &&
    reply.launch_id === child.launchId &&
    typeof reply.pid === 'number' &&
    (reply.pid === child.pid || parentOf(reply.pid) === child.pid)
  );
}

/** A health route's answer: its status and its body (undefined when not JSON). */
export interface HealthAnswer {
  readonly status: number;
  readonly body: unknown;
}

/** Who a health answer that is not the child's comes from, for the error naming the port's holder. */
export function answererOf(answer: HealthAnswer): string {
  const reply = answer.body as Partial<HealthReply> | null | undefined;
  if (typeof reply !== 'object' || reply === null || typeof reply.pid !== 'number') {
    return `a server that answers HTTP ${answer.status} without a pid`;
  }
  const who = typeof reply.name === 'string' ? `, ${String(reply.kind)} '${reply.name}'` : '';
  return `another process (pid ${reply.pid}${who})`;
}

/** The system error a server's log gives for a failed listen (EADDRINUSE, EACCES, …), if any. */
export function listenErrorCode(log: string): string | undefined {
  return /\blisten (E[A-Z]+)\b/.exec(log)?.[1];
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

/** What the log holds from byte `from` on: a log is appended to across restarts. */
function logSince(path: string, from: number): string {
  try {
    return readFileSync(path).subarray(from).toString('utf8');
  } catch {
    return '';
  }
}

function lastLines(log: string, lines = 20): string {
  return log.trimEnd().split('\n').slice(-lines).join('\n') || '(no log)';
}

/** How waiting for a child's health ended. */
export type HealthOutcome =
  | { readonly kind: 'healthy' }
  | { readonly kind: 'exited'; readonly exit: string; readonly answeredBy?: string }
  | { readonly kind: 'timeout'; readonly afterMs: number; readonly answeredBy?: string };

async function healthAnswer(url: string, signal: AbortSignal): Promise<HealthAnswer | undefined> {
  try {
    const reply = await fetch(url, {
      signal: AbortSignal.any([signal, AbortSignal.timeout(1000)]),
    });
    const body: unknown = await reply.json().catch(() => undefined);
    return { status: reply.status, body };
  } catch {
    return undefined; // Not listening yet, or the child exited.
  }
}

/**
 * Whether a server's log holds its listening line: `serve` prints it once the server accepts
 * calls, and a server with several workers only once every worker listens (one alone answers
 * `/health` before the others do).
 */
export function hasListeningLine(log: string): boolean {
  return log.split('\n').some((line) => line.startsWith('{"event":"listening"'));
}

/**
 * Polls `url` until `child` itself answers it and `announced()` holds (call it right after the
 * spawn, before the child can exit). The child's exit ends the wait at once (it aborts the request
 * in flight), not at the timeout; a reply from another process is kept to name it.
 */
export async function awaitOwnHealth(
  proc: ChildProcess,
  child: LaunchedChild,
  url: string,
  timeoutMs = HEALTH_TIMEOUT_MS,
  announced: () => boolean = () => true,
): Promise<HealthOutcome> {
  const exited = new AbortController();
  let exit: string | undefined;
  proc.once('exit', (code, signal) => {
    exit = signal ?? `exit code ${code}`;
    exited.abort();
  });
  const until = Date.now() + timeoutMs;
  let answeredBy: string | undefined;
  while (exit === undefined && Date.now() < until) {
    const answer = await healthAnswer(url, exited.signal);
    if (answer !== undefined && exit === undefined) {
      if (!provesLaunchedChild(answer.body, child)) answeredBy = answererOf(answer);
      else if (announced()) return { kind: 'healthy' };
    }
    await delay(50, undefined, { signal: exited.signal }).catch(() => undefined);
  }
  const holder = answeredBy === undefined ? {} : { answeredBy };
  return exit === undefined
    ? { kind: 'timeout', afterMs: timeoutMs, ...holder }
    : { kind: 'exited', exit, ...holder };
}

/** The error of a server that did not come up: which server, which port, why, and its log. */
export function launchFailure(
  server: { name: string; host: string; port: number; healthUrl: string },
  outcome: Exclude<HealthOutcome, { kind: 'healthy' }>,
  log: string,
): LaunchError {
  const { name, host, port } = server;
  const address = `${host}:${port}`;
  const code = outcome.kind === 'exited' ? listenErrorCode(log) : undefined;
  const reason =
    code ??
    (outcome.kind === 'exited'
      ? `exited (${outcome.exit})`
      : `not healthy within ${outcome.afterMs} ms`);
  const what =
    outcome.kind === 'timeout'
      ? `${name} not healthy at ${server.healthUrl} within ${outcome.afterMs} ms`
      : code === undefined
        ? `${name} exited (${outcome.exit}) before it was healthy on ${address}`
        : `${name} could not bind ${address} (${code}) and exited (${outcome.exit})`;
  const holder =
    outcome.answeredBy === undefined
      ? ''
      : `; port ${port} is answered by ${outcome.answeredBy}, not by this launch`;
  return new LaunchError(`${what}${holder}:\n${lastLines(log)}`, [
    {
      server: name,
      host,
      port,
      reason,
      ...(outcome.answeredBy === undefined ? {} : { answered_by: outcome.answeredBy }),
    },
  ]);
}

/** The failures of servers started side by side as one error, so each of them is named. */
function firstOrAll(errors: readonly unknown[]): unknown {
  if (errors.length === 1 || !errors.every((err) => err instanceof LaunchError)) return errors[0];
  return new LaunchError(
    errors.map((err) => err.message).join('\n'),
    errors.flatMap((err) => err.failures),
  );
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
    const logStart = fstatSync(log).size;
    const launchId = randomUUID();
    let child: ChildProcess;
    try {
      child = spawn(
        process.execPath,
        [...SERVER_NODE_FLAGS, CLI_MAIN, 'serve', '--config', this.configPath, '--server', name],
        {
          detached: true,
          stdio: ['ignore', log, log],
          env: { ...serverEnv(this.env), [LAUNCH_ID_ENV]: launchId },
          cwd: this.runDir,
        },
      );
    } finally {
      closeSync(log);
    }
    const pid = child.pid;
    if (pid === undefined) throw new LaunchError(`${name}: could not spawn ${process.execPath}`);
    child.unref();
    const url = serverUrl(this.stack, name);
    const health = healthUrl(url);
    const outcome = await awaitOwnHealth(child, { pid, launchId }, health, HEALTH_TIMEOUT_MS, () =>
      hasListeningLine(logSince(logPath, logStart)),
    );
    if (outcome.kind !== 'healthy') {
      if (outcome.kind === 'timeout') signalGroup(pid, 'SIGKILL');
      const server = { name, host: settings.host, port: settings.port, healthUrl: health };
      throw launchFailure(server, outcome, logSince(logPath, logStart));
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
      const failed = started.flatMap((outcome) =>
        outcome.status === 'rejected' ? [outcome.reason as unknown] : [],
      );
      if (failed.length > 0) throw firstOrAll(failed);
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
  writeFileSync(configPath, resolvedStackText(opts.configPath, ports, runDir));
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
