/**
 * One way to start a server: each server package exports a `ServerKindModule` (its kind, the
 * schema of its apps' keys and `fromStack`), `ckpt-gym serve` is a table of them, and a package's
 * own bin is `runServerMain(itsKind)`. The close order of a running server belongs to its package.
 */
import { parseArgs } from 'node:util';

import type { Express } from 'express';

import { CkptGymError, ConfigError } from './errors.js';
import { createLogger, type Logger } from './logging.js';
import { listen, type ListeningServer } from './server.js';
import { startTracingFor, stopTracing } from './telemetry/tracing.js';
import {
  type KindConfigSchema,
  type KindConfigSchemas,
  loadStackFile,
  type ServerKind,
  type ServerSettings,
  serverSettings,
  type StackSettings,
} from './settings.js';
import type { WorkerCoordinator } from './workers/coordinator.js';
import { isServerWorker, startWorkers, workerLinkFromEnv } from './workers/primary.js';
import { RUNTIME_DIR_ENV, WORKER_INDEX_ENV } from './workers/types.js';
import type { WorkerLink } from './workers/worker-link.js';

/** A server of a stack file, built and listening. */
export interface GymServer {
  readonly name: string;
  readonly kind: ServerKind;
  readonly app: Express;
  /** The control plane, when the server is a checkpoint participant. */
  readonly plane: { dispose(): void } | undefined;
  readonly host: string;
  readonly port: number;
  readonly url: string;
  /** Stops accepting, lets requests in flight finish (as the kind decides), releases timers and pools. */
  close(): Promise<void>;
}

export interface FromStackOptions {
  logger?: Logger;
  /** Listen here instead of the stack file's port (0: a free port). */
  port?: number;
  /**
   * Set in a forked worker of a server with several workers (`ServerKindModule.workers`): build
   * this worker's share of the server, `await worker.link.attach(side)` with its gate and marks,
   * and mount the control routes over `worker.link.controlTarget()` (`GymAppOptions.control`).
   */
  worker?: WorkerContext;
}

/** What a forked worker's `fromStack` gets. */
export interface WorkerContext {
  /** This worker's index among the server's workers, from 1. */
  readonly index: number;
  /** Its link to the coordinator; undefined when checkpointing is off (nothing to coordinate). */
  readonly link: WorkerLink | undefined;
  /** The server's runtime directory (each worker's own socket for session routing is there). */
  readonly runtimeDir: string;
}

/**
 * How a kind runs `num_workers > 1`: the primary process builds the kind's coordinator (the
 * participant its control plane wraps) and forks the workers; each worker runs the kind's
 * `fromStack` with `options.worker`.
 */
export interface WorkersSupport {
  /** In the primary, when checkpointing is on: the coordinator of the named server. */
  coordinator(
    stack: StackSettings,
    name: string,
    options: { readonly expectedWorkers: number; readonly logger: Logger },
  ): WorkerCoordinator;
}

export interface ServerKindModule<K extends ServerKind = ServerKind> {
  readonly kind: K;
  /** Checked when the stack file is loaded (`parseStackFile`'s `kinds`). */
  readonly configSchema: KindConfigSchema;
  /** Builds the named server of the stack and listens on its host and port. */
  fromStack(stack: StackSettings, name: string, options?: FromStackOptions): Promise<GymServer>;
  /** Present when the kind can run several worker processes per server. */
  readonly workers?: WorkersSupport;
}

/** A started server process: one `GymServer`, or the primary of several workers. */
export type RunningServer = Pick<GymServer, 'name' | 'kind' | 'host' | 'port' | 'url' | 'close'>;

/** What a kind adds to its app to make it a `GymServer`: its plane and its close order. */
export interface GymServerParts {
  readonly plane: GymServer['plane'];
  close(listening: ListeningServer): Promise<void>;
}

/** Listens on the server's host and port (or `options.port`); `close` gets the listener. */
export async function listenGymServer(
  settings: ServerSettings,
  app: Express,
  options: FromStackOptions,
  parts: GymServerParts,
): Promise<GymServer> {
  const listening = await listen(app, options.port ?? settings.port, settings.host);
  return {
    name: settings.name,
    kind: settings.kind,
    app,
    plane: parts.plane,
    host: settings.host,
    port: listening.port,
    url: listening.url,
    close: () => parts.close(listening),
  };
}

/** The kinds' schemas, as `parseStackFile` takes them. */
export function kindSchemas(kinds: Iterable<ServerKindModule>): KindConfigSchemas {
  return Object.fromEntries([...kinds].map((k) => [k.kind, k.configSchema]));
}

/** The named server, refused unless it is of `kind`: what each `fromStack` starts with. */
export function serverOfKind(stack: StackSettings, name: string, kind: ServerKind): ServerSettings {
  const server = serverSettings(stack, name);
  if (server.kind !== kind) {
    throw new ConfigError(`servers.${name}: kind is ${server.kind}, not ${kind}`);
  }
  return server;
}

/** The one line a server process prints once it accepts calls. */
export function listeningLine(server: RunningServer, stack?: StackSettings): string {
  const { name, kind, host, port, url } = server;
  return JSON.stringify({
    event: 'listening',
    server: name,
    kind,
    ...(stack ? { app: serverSettings(stack, name).app } : {}),
    host,
    port,
    url,
    ...(stack ? { checkpointing: stack.checkpoint !== undefined } : {}),
  });
}

const USAGE = '--config <stack file> --server <name> [--port N]';

/**
 * Starts the server `--server` of the stack file `--config` with `kind` (the stack file checked
 * against its schema) and prints the listening line. A bad argument or file is a `ConfigError`.
 */
export async function startServerMain(
  kind: ServerKindModule,
  argv: readonly string[],
  print: (line: string) => void = (line) => void process.stdout.write(`${line}\n`),
): Promise<RunningServer> {
  let values;
  try {
    ({ values } = parseArgs({
      args: [...argv],
      options: { config: { type: 'string' }, server: { type: 'string' }, port: { type: 'string' } },
      strict: true,
    }));
  } catch (err) {
    throw new ConfigError(`${(err as Error).message}; usage: ${USAGE}`);
  }
  if (!values.config || !values.server) throw new ConfigError(`usage: ${USAGE}`);
  if (values.port !== undefined && !/^\d+$/.test(values.port)) {
    throw new ConfigError(`--port must be an integer, got ${values.port}`);
  }
  const stack = loadStackFile(values.config, process.env, kindSchemas([kind]));
  const options: FromStackOptions = values.port === undefined ? {} : { port: Number(values.port) };
  return startServer(kind, stack, values.server, options, print);
}

/**
 * Starts the server `name` of a loaded stack with `kind` and prints its listening line. With
 * `num_workers > 1` and a kind that supports workers, this process is the primary (it forks the
 * workers, which run this again with the same argv, and prints the line once all of them
 * listen) or one of those workers (it prints nothing).
 */
export async function startServer(
  kind: ServerKindModule,
  stack: StackSettings,
  name: string,
  options: FromStackOptions,
  print: (line: string) => void,
): Promise<RunningServer> {
  startTracingFor({ service: name, instance: name }, stack.telemetry);
  const settings = serverOfKind(stack, name, kind.kind);
  if (settings.numWorkers <= 1 || !kind.workers) {
    const server = await kind.fromStack(stack, name, options);
    print(listeningLine(server, stack));
    return server;
  }
  if (isServerWorker()) return startWorker(kind, stack, settings, options);
  const server = await startPrimary(kind.workers, stack, settings, options);
  print(listeningLine(server, stack));
  return server;
}

/** A forked worker: the kind's server with its link; the primary prints the listening line. */
async function startWorker(
  kind: ServerKindModule,
  stack: StackSettings,
  settings: ServerSettings,
  options: FromStackOptions,
): Promise<RunningServer> {
  const logger = options.logger ?? createLogger({ server: settings.name, kind: settings.kind });
  const link = workerLinkFromEnv(logger, settings.kind);
  const index = link?.index ?? Number(process.env[WORKER_INDEX_ENV]);
  let stopping = false;
  // Cluster exits a worker with 0 once its primary is gone: only a clean stop is a success.
  process.on('exit', (code) => {
    if (!stopping && code === 0) process.exitCode = 1;
  });
  const server = await kind.fromStack(stack, settings.name, {
    ...options,
    worker: { index, link, runtimeDir: process.env[RUNTIME_DIR_ENV] ?? '' },
  });
  return {
    ...pickRunning(server),
    close: async () => {
      stopping = true;
      await server.close();
      await link?.detach();
    },
  };
}

/** The primary of several workers: the coordinator and the forked workers; it serves no HTTP. */
async function startPrimary(
  workers: WorkersSupport,
  stack: StackSettings,
  settings: ServerSettings,
  options: FromStackOptions,
): Promise<RunningServer> {
  const logger = options.logger ?? createLogger({ server: settings.name, kind: settings.kind });
  const coordinator = stack.checkpoint
    ? workers.coordinator(stack, settings.name, { expectedWorkers: settings.numWorkers, logger })
    : undefined;
  const primary = await startWorkers({
    settings: options.port === undefined ? settings : { ...settings, port: options.port },
    checkpoint: stack.checkpoint,
    coordinator,
    logger,
  });
  const { host, port, url } = primary;
  return { name: settings.name, kind: settings.kind, host, port, url, close: primary.close };
}

function pickRunning(server: RunningServer): Omit<RunningServer, 'close'> {
  const { name, kind, host, port, url } = server;
  return { name, kind, host, port, url };
}

/**
 * A server process: `start` it, then on SIGTERM or SIGINT close it and exit 0. A bad argument or
 * stack file exits 2, any other failure to start (a port in use) 1.
 */
export function runServerProcess(
  program: string,
  start: () => Promise<{ close(): Promise<void> }>,
) {
  const fail = (message: string, code: number): never => {
    process.stderr.write(`${program}: ${message}\n`);
    process.exit(code);
  };
  return start().then(
    (server) => {
      let stopping = false;
      const stop = (): void => {
        if (stopping) return;
        stopping = true;
        // Spans still batched are exported before the process goes.
        server
          .close()
          .then(stopTracing)
          .then(
            () => process.exit(0),
            (err: unknown) => fail(`close failed: ${String(err)}`, 1),
          );
      };
      process.on('SIGTERM', stop);
      process.on('SIGINT', stop);
    },
    (err: unknown) =>
      err instanceof CkptGymError
        ? fail(err.message, err instanceof ConfigError ? 2 : 1)
        : fail(`cannot start: ${err instanceof Error ? err.message : String(err)}`, 1),
  );
}

/** What a server package's bin runs: `<program> --config <stack file> --server <name> [--port N]`. */
export function runServerMain(
  program: string,
  kind: ServerKindModule,
  argv: readonly string[] = process.argv.slice(2),
): Promise<void> {
  if (argv.includes('--help') || argv.includes('-h')) {
    process.stdout.write(`${serverMainUsage(program, kind.kind)}\n`);
    process.exit(0);
  }
  return runServerProcess(program, () => startServerMain(kind, argv));
}

function serverMainUsage(program: string, kind: ServerKind): string {
  return `usage: ${program} ${USAGE}

Runs the server <name> (of kind ${kind}) of a stack file. Prints one JSON line
{"event":"listening",…} on stdout once it accepts calls; SIGTERM or SIGINT stops accepting,
lets requests in flight finish, and exits 0. A bad option or stack file exits 2.

options:
  --config FILE  the stack file
  --server NAME  the server to run
  --port N       listen on N instead of the stack file's port (0: a free port)
  --help, -h     show this help`;
}
