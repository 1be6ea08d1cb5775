/**
 * Server bootstrap shared by every gym server: the rollout-prefix middleware, a health route, the
 * control plane (only when checkpointing is enabled), JSON errors for everything, and a listener
 * that closes cleanly. A server package builds its routes between `createGymApp` and `finish`.
 */
import { readFileSync } from 'node:fs';
import {
  createServer,
  type IncomingMessage,
  maxHeaderSize,
  type RequestListener,
  type Server,
  type ServerResponse,
  STATUS_CODES,
} from 'node:http';
import type { AddressInfo, Socket } from 'node:net';
import type { Duplex } from 'node:stream';

import express, { type Express, type RequestHandler } from 'express';

import { ControlPlane, type ControlPlaneOptions, installControlPlane } from './control/index.js';
import type { ControlTarget } from './control/routes.js';
import {
  type CkptGymError,
  ConfigError,
  HeadersTooLargeError,
  MalformedRequestError,
  OverloadedError,
  PayloadTooLargeError,
  shouldRetry,
} from './errors.js';
import { errorMiddleware, notFoundMiddleware } from './express.js';
import { KEEP_ALIVE_IDLE_MS } from './http-client.js';
import { rolloutPrefixMiddleware } from './identity.js';
import { createLogger, type Logger } from './logging.js';
import type { Participant } from './participant.js';
import type { CheckpointSettings, ServerKind } from './settings.js';
import type { CheckpointRecord } from './store.js';
import { tracingObserver } from './telemetry/checkpoint-spans.js';
import { requestTelemetry } from './telemetry/http.js';
import { GymMetrics, METRICS_PATH, metricsHandler, metricsObserver } from './telemetry/metrics.js';

export interface GymAppOptions<R extends CheckpointRecord> {
  /** The server's name in the stack file; also its checkpoint instance. */
  name: string;
  kind: ServerKind;
  /** Undefined when checkpointing is off: no control routes, no participant. */
  checkpoint: CheckpointSettings | undefined;
  participant?: Participant<R>;
  /**
   * In a worker of a server with several workers: the control routes forward to the coordinator
   * (`WorkerLink.controlTarget()`) and the worker has no plane of its own; `participant` is unused.
   */
  control?: ControlTarget;
  logger?: Logger;
  /**
   * In a worker of a server with several workers: sends a request for a session another worker
   * owns to that worker (`SessionRouter.middleware()`); runs before anything else sees it.
   */
  sessionRouter?: RequestHandler;
  plane?: Omit<
    ControlPlaneOptions,
    'leaseGraceSeconds' | 'logger' | 'signingKey' | 'fileMode' | 'dirMode'
  >;
}

export interface GymApp<R extends CheckpointRecord> {
  readonly app: Express;
  readonly logger: Logger;
  /** The server's metrics (`GET /metrics`); `countEvent` is the seam for events outside the plane. */
  readonly metrics: GymMetrics;
  /** The control plane, present exactly when checkpointing is on. */
  readonly plane: ControlPlane<R> | undefined;
  /** Mounts the JSON 404 and error handlers; call after the server's own routes. */
  finish(): Express;
}

/**
 * The environment variable through which a launcher hands each server process a nonce of its own
 * launch; `/health` echoes it, so the launcher can tell its child from another process that
 * answers on the same port (an older stack, say).
 */
export const LAUNCH_ID_ENV = 'CKPT_GYM_LAUNCH_ID';

/** What `GET /health` answers: who this is, and which process (its pid and launch nonce). */
export interface HealthReply {
  readonly status: 'ok';
  readonly name: string;
  readonly kind: ServerKind;
  readonly pid: number;
  /** The launcher's nonce from LAUNCH_ID_ENV; null when the process was started without one. */
  readonly launch_id: string | null;
}

export function healthReply(
  name: string,
  kind: ServerKind,
  proc: { pid: number; env: NodeJS.ProcessEnv } = process,
): HealthReply {
  return { status: 'ok', name, kind, pid: proc.pid, launch_id: proc.env[LAUNCH_ID_ENV] ?? null };
}

/** Each gym app's metrics, for what answers outside express (an overloaded refusal). */
const appMetrics = new WeakMap<Express, GymMetrics>();

export function createGymApp<R extends CheckpointRecord>(options: GymAppOptions<R>): GymApp<R> {
  const logger = options.logger ?? createLogger({ server: options.name, kind: options.kind });
  const app = express();
  app.disable('x-powered-by');
  app.set('etag', false);
  if (options.sessionRouter) app.use(options.sessionRouter);
  const metrics = new GymMetrics({ server: options.name, kind: options.kind });
  appMetrics.set(app, metrics);
  app.use(requestTelemetry(metrics, logger));
  const health = healthReply(options.name, options.kind);
  app.get('/health', (_req, res) => {
    res.json(health);
  });
  app.get(METRICS_PATH, metricsHandler(metrics));

  let plane: ControlPlane<R> | undefined;
  if (options.checkpoint && options.control) {
    const { control } = options;
    if (control.metrics) metrics.addSource(() => control.metrics!());
    installControlPlane(app, control, options.checkpoint.controlAuthToken, { logger });
  } else if (options.checkpoint) {
    if (!options.participant) {
      throw new ConfigError(
        `server ${options.name}: checkpointing is on but it has no participant`,
      );
    }
    metrics.watchParticipant(options.participant);
    plane = new ControlPlane(options.participant, {
      ...options.plane,
      observers: [metricsObserver(metrics), ...(options.plane?.observers ?? []), tracingObserver()],
      leaseGraceSeconds: options.checkpoint.leaseGraceSeconds,
      signingKey: options.checkpoint.signingKey,
      fileMode: options.checkpoint.fileMode,
      dirMode: options.checkpoint.dirMode,
      logger,
    });
    installControlPlane(app, plane, options.checkpoint.controlAuthToken, { logger });
  }
  app.use(rolloutPrefixMiddleware());

  return {
    app,
    logger,
    metrics,
    plane,
    finish() {
      app.use(notFoundMiddleware());
      app.use(errorMiddleware(logger));
      return app;
    },
  };
}

export interface ListeningServer {
  readonly server: Server;
  readonly host: string;
  readonly port: number;
  readonly url: string;
  /** Stops accepting, ends idle keep-alive connections, and resolves once the server closed. */
  close(): Promise<void>;
}

/**
 * How long a server keeps an idle keep-alive connection: longer than the clients' idle timeout
 * (KEEP_ALIVE_IDLE_MS), so it is always the client that closes an idle socket. With node's 5 s
 * default a request sent on a socket the server is just closing fails with ECONNRESET, and
 * non-idempotent gym calls are never retried.
 */
export const SERVER_KEEP_ALIVE_MS = KEEP_ALIVE_IDLE_MS + 50_000;

/**
 * The accept queue asked of the kernel (it clamps to `net.core.somaxconn`, 4096 on current
 * kernels). A controller starting thousands of rollouts opens that many connections at once; with
 * node's default of 511 the queue overflows, the kernel answers with SYN cookies, and a handshake
 * it cannot complete in time is reset — an ECONNRESET on a call that is never retried.
 */
export const LISTEN_BACKLOG = 65_535;

/**
 * How long a server waits for a request's headers, counted from the accept: far beyond node's
 * 60 s. Under a burst of thousands of rollouts a busy event loop reaches a connection late, and
 * node's periodic check answers 408 before it reads bytes already waiting in the socket — a failed
 * episode for a request that arrived in time. Gym servers sit on a trusted network; slow clients
 * are not the threat here.
 */
export const SERVER_HEADERS_TIMEOUT_MS = 10 * 60_000;

/**
 * Applies SERVER_KEEP_ALIVE_MS and SERVER_HEADERS_TIMEOUT_MS to a server, and no overall request
 * timeout (an episode's `/run` body is small, but a checkpoint body may be large and slow to come).
 */
export function keepIdleConnections(server: Server): void {
  server.keepAliveTimeout = SERVER_KEEP_ALIVE_MS;
  server.headersTimeout = SERVER_HEADERS_TIMEOUT_MS;
  server.requestTimeout = 0;
}

/**
 * The typed error answering a request node's HTTP parser refused before any route saw it, or
 * undefined for a failure nobody can be answered for (a reset, a timed-out half-sent request).
 */
function parserErrorReply(err: NodeJS.ErrnoException): CkptGymError | undefined {
  const reason = (err as { reason?: unknown }).reason;
  switch (err.code) {
    case 'HPE_HEADER_OVERFLOW':
      return new HeadersTooLargeError(`request headers are larger than ${maxHeaderSize} bytes`);
    case 'HPE_CHUNK_EXTENSIONS_OVERFLOW':
      return new PayloadTooLargeError('request chunk extensions are too large');
    default:
      return err.code?.startsWith('HPE_')
        ? new MalformedRequestError(
            `the HTTP request could not be parsed: ${typeof reason === 'string' ? reason : err.code}`,
          )
        : undefined;
  }
}

/** A complete HTTP/1.1 response carrying `err` in the standard JSON shape; the connection closes. */
function rawErrorResponse(err: CkptGymError): string {
  const body = JSON.stringify(err.toBody());
  return [
    `HTTP/1.1 ${err.status} ${STATUS_CODES[err.status] ?? ''}`,
    'content-type: application/json; charset=utf-8',
    `content-length: ${Buffer.byteLength(body)}`,
    `x-should-retry: ${String(shouldRetry(err.code))}`,
    'connection: close',
    '',
    body,
  ].join('\r\n');
}

/** How long an answered broken request's socket may drain before it is destroyed anyway. */
const PARSER_ERROR_LINGER_MS = 5_000;

/**
 * Answers what node's HTTP parser refuses (too large headers, a malformed request line or header,
 * bad chunked framing) in the standard JSON error shape, where node's own answer is a bare 400,
 * 413 or 431. With a `clientError` listener node writes nothing, and calls it again for every
 * later chunk of the broken request. An answered socket drains until the client closes it (a
 * destroy at once could reset the connection before the client read the answer), for at most
 * PARSER_ERROR_LINGER_MS. As node does, a socket whose response already started, or that cannot
 * be answered, is destroyed; a route still reading the broken body writes into the ended socket
 * in vain.
 */
export function answerParserErrorsAsJson(server: Server): void {
  server.on('clientError', (err: NodeJS.ErrnoException, socket: Duplex) => {
    if (socket.writableEnded) return;
    const inFlight = (socket as Duplex & { _httpMessage?: ServerResponse | null })._httpMessage;
    const reply = parserErrorReply(err);
    if (reply === undefined || !socket.writable || inFlight?.headersSent) {
      socket.destroy();
      return;
    }
    socket.end(rawErrorResponse(reply));
    socket.resume();
    const linger = setTimeout(() => socket.destroy(), PARSER_ERROR_LINGER_MS).unref();
    socket.once('close', () => clearTimeout(linger));
  });
}

/**
 * Descriptors no inbound socket may take, below the process's open-files soft limit: checkpoint
 * writes, restore reads, logs and the server's own outbound connections need descriptors while
 * the server is flooded, and a process out of descriptors cannot even accept a control call.
 */
export const FILE_DESCRIPTOR_RESERVE = 1_024;

/**
 * Sockets accepted above the data-plane bound, on which only control requests are served: the
 * room a controller always finds for discover, prepare and commit when data connections are full.
 */
export const CONTROL_CONNECTION_RESERVE = 128;

/**
 * While a server is at its data-plane bound, a connection without a request in flight (idle, or
 * still sending its headers) is closed after this long. Only then: with room, the 10-minute
 * headers grace of SERVER_HEADERS_TIMEOUT_MS holds, so a burst read late is still served.
 */
export const OVERLOAD_IDLE_TIMEOUT_MS = 30_000;

/** Requests under this path are control calls, served on every connection the server accepted. */
const CONTROL_PATH_PREFIX = '/ng-control/';

/**
 * A scrape is served on every connection too (Prometheus must see an overloaded server), but its
 * socket is not a controller's: it may be evicted like any idle one.
 */
function servedOverBound(url: string | undefined): boolean {
  return url?.startsWith(CONTROL_PATH_PREFIX) === true || url === METRICS_PATH;
}

/** How many connections a server keeps, and how long an idle one may stay when it is full. */
export interface ConnectionLimits {
  /** The hard ceiling (`server.maxConnections`): node closes a socket accepted beyond it. */
  readonly maxConnections: number;
  /**
   * The data-plane bound: a new connection beyond it evicts the oldest idle one; if none is idle
   * it is admitted into the control reserve, where a data request is answered 503 `overloaded`.
   */
  readonly maxDataConnections: number;
  /** OVERLOAD_IDLE_TIMEOUT_MS, injectable for tests. */
  readonly overloadIdleTimeoutMs: number;
}

/** The soft "Max open files" limit in the text of /proc/<pid>/limits; Infinity when unlimited or absent. */
export function openFilesSoftLimit(procLimits: string): number {
  const soft = /^Max open files\s+(\S+)/m.exec(procLimits)?.[1];
  const limit = Number(soft);
  return Number.isSafeInteger(limit) && limit > 0 ? limit : Infinity;
}

/**
 * The connection limits for an open-files soft limit: the ceiling keeps FILE_DESCRIPTOR_RESERVE
 * descriptors back, the data bound CONTROL_CONNECTION_RESERVE sockets more (each reserve at most a
 * quarter of what is left, so a small limit still leaves data connections). With the 20,000 of a
 * gym host: 18,848 data connections, above the ~16,300 descriptors of 8,000 rollouts in flight.
 */
export function connectionLimits(
  softLimit: number,
): Omit<ConnectionLimits, 'overloadIdleTimeoutMs'> {
  if (!Number.isFinite(softLimit)) {
    return { maxConnections: Infinity, maxDataConnections: Infinity };
  }
  const maxConnections = softLimit - Math.min(FILE_DESCRIPTOR_RESERVE, Math.floor(softLimit / 4));
  const control = Math.min(CONTROL_CONNECTION_RESERVE, Math.floor(maxConnections / 4));
  return { maxConnections, maxDataConnections: maxConnections - control };
}

/** The connection limits of this process, from its real open-files soft limit. */
export function processConnectionLimits(): Omit<ConnectionLimits, 'overloadIdleTimeoutMs'> {
  let text = '';
  try {
    text = readFileSync('/proc/self/limits', 'utf8');
  } catch {
    // No procfs (not Linux): nothing to derive a bound from; node's own behaviour stays.
  }
  return connectionLimits(openFilesSoftLimit(text));
}

interface SocketState {
  inflight: number;
  /** When the socket was accepted or last finished a response. */
  idleSince: number;
  /** `bytesRead` at that moment: more since means the next request's headers are coming. */
  bytesAtIdle: number;
  admittedOverBound: boolean;
  /** It carried an authorized control call: a controller's keep-alive socket, never evicted. */
  control: boolean;
}

/**
 * Connection accounting of one server: every open socket, and those without a request in flight
 * in the order they became idle, oldest first. See ConnectionLimits for the rules.
 */
class ConnectionAdmission {
  readonly #sockets = new Map<Socket, SocketState>();
  readonly #idle = new Set<Socket>();
  #sweep: NodeJS.Timeout | undefined;

  constructor(readonly limits: ConnectionLimits) {}

  get open(): number {
    return this.#sockets.size;
  }

  admit(socket: Socket): void {
    const state: SocketState = {
      inflight: 0,
      idleSince: Date.now(),
      bytesAtIdle: 0,
      admittedOverBound: false,
      control: false,
    };
    this.#sockets.set(socket, state);
    if (this.#overBound()) this.#evictOldestIdle();
    state.admittedOverBound = this.#overBound();
    this.#idle.add(socket);
    socket.once('close', () => this.#forget(socket));
    this.#updateSweep();
  }

  /** Accounts a request; false for a data request on a reserve socket while still over the bound. */
  begin(req: IncomingMessage, res: ServerResponse): boolean {
    const socket = req.socket as Socket;
    const state = this.#sockets.get(socket);
    const control = req.url?.startsWith(CONTROL_PATH_PREFIX) === true;
    if (!state) return true;
    state.inflight += 1;
    this.#idle.delete(socket);
    res.once('close', () => this.#end(socket, state, control && res.statusCode !== 401));
    return servedOverBound(req.url) || !state.admittedOverBound || !this.#overBound();
  }

  stop(): void {
    clearInterval(this.#sweep);
    this.#sweep = undefined;
  }

  #overBound(): boolean {
    return this.#sockets.size > this.limits.maxDataConnections;
  }

  #end(socket: Socket, state: SocketState, control: boolean): void {
    state.inflight -= 1;
    state.control ||= control;
    if (state.inflight > 0 || state.control || socket.destroyed) return;
    state.idleSince = Date.now();
    state.bytesAtIdle = socket.bytesRead;
    this.#idle.add(socket);
  }

  /** Closes the oldest socket that has sent nothing since it became idle; one sending headers is left to the sweep. */
  #evictOldestIdle(): void {
    for (const socket of this.#idle) {
      this.#idle.delete(socket);
      if (socket.bytesRead !== this.#sockets.get(socket)?.bytesAtIdle) continue;
      this.#close(socket);
      return;
    }
  }

  /** Closes every socket without a request in flight for longer than the overload timeout. */
  #closeStale(): void {
    const cutoff = Date.now() - this.limits.overloadIdleTimeoutMs;
    for (const [socket, state] of this.#sockets) {
      if (state.inflight === 0 && !state.control && state.idleSince <= cutoff) this.#close(socket);
    }
  }

  #close(socket: Socket): void {
    this.#forget(socket);
    socket.destroy();
  }

  #forget(socket: Socket): void {
    this.#sockets.delete(socket);
    this.#idle.delete(socket);
    this.#updateSweep();
  }

  /** The stale sweep runs only while the server is at its bound. */
  #updateSweep(): void {
    const full = this.#sockets.size >= this.limits.maxDataConnections;
    if (full && this.#sweep === undefined) {
      const period = Math.max(10, Math.floor(this.limits.overloadIdleTimeoutMs / 4));
      this.#sweep = setInterval(() => this.#closeStale(), period).unref();
    } else if (!full) {
      this.stop();
    }
  }
}

/** Answers a refused data request 503 `overloaded` in the JSON error shape, and closes the connection. */
function refuseOverloaded(res: ServerResponse, open: number): void {
  const err = new OverloadedError(
    `the server holds ${open} connections, above its data-plane bound; retry with backoff`,
  );
  const body = JSON.stringify(err.toBody());
  res.writeHead(err.status, {
    'content-type': 'application/json; charset=utf-8',
    'content-length': Buffer.byteLength(body),
    'x-should-retry': String(shouldRetry(err.code)),
    connection: 'close',
  });
  res.end(body);
}

/** The request listener: accounts each request, and serves it or refuses it as overloaded. */
function admittedRequests(app: Express, admission: ConnectionAdmission): RequestListener {
  return (req, res) => {
    if (admission.begin(req, res)) app(req, res);
    else {
      appMetrics.get(app)?.countEvent('refused', { code: 'overloaded' });
      refuseOverloaded(res, admission.open);
    }
  };
}

/** Limits for `listen`; by default derived from the process's open-files limit. */
export type ListenOptions = Partial<ConnectionLimits>;

function resolveLimits(options: ListenOptions): ConnectionLimits {
  const own = processConnectionLimits();
  const maxDataConnections = options.maxDataConnections ?? own.maxDataConnections;
  return {
    maxDataConnections,
    maxConnections:
      options.maxConnections ??
      Math.min(own.maxConnections, maxDataConnections + CONTROL_CONNECTION_RESERVE),
    overloadIdleTimeoutMs: options.overloadIdleTimeoutMs ?? OVERLOAD_IDLE_TIMEOUT_MS,
  };
}

/**
 * Listens on `host:port` (0 picks a free port) and resolves with the bound address. Connections
 * are bounded by `options` (see ConnectionLimits), so a flood never takes the descriptors a
 * control call or a checkpoint write needs.
 */
export function listen(
  app: Express,
  port: number,
  host = '127.0.0.1',
  options: ListenOptions = {},
): Promise<ListeningServer> {
  return new Promise((resolve, reject) => {
    const admission = new ConnectionAdmission(resolveLimits(options));
    const server = createServer(admittedRequests(app, admission));
    server.maxConnections = admission.limits.maxConnections;
    server.on('connection', (socket: Socket) => admission.admit(socket));
    keepIdleConnections(server);
    answerParserErrorsAsJson(server);
    server.listen({ port, host, backlog: LISTEN_BACKLOG });
    server.once('error', reject);
    server.once('listening', () => {
      server.off('error', reject);
      const bound = (server.address() as AddressInfo).port;
      const urlHost = host.includes(':') ? `[${host}]` : host === '0.0.0.0' ? '127.0.0.1' : host;
      resolve({
        server,
        host,
        port: bound,
        url: `http://${urlHost}:${bound}`,
        close: () =>
          new Promise<void>((done) => {
            admission.stop();
            server.close(() => done());
            server.closeIdleConnections();
          }),
      });
    });
  });
}
