/**
 * Server bootstrap shared by every gym server: the rollout-prefix middleware, a health route, the
 * control plane (only when checkpointing is enabled), JSON errors for everything, and a listener
 * that closes cleanly. A server package builds its routes between `createGymApp` and `finish`.
 */
import {
  createServer,
  maxHeaderSize,
  type Server,
  type ServerResponse,
  STATUS_CODES,
} from 'node:http';
import type { AddressInfo } from 'node:net';
import type { Duplex } from 'node:stream';

import express, { type Express } from 'express';

import { ControlPlane, type ControlPlaneOptions, installControlPlane } from './control/index.js';
import {
  type CkptGymError,
  ConfigError,
  HeadersTooLargeError,
  MalformedRequestError,
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

export interface GymAppOptions<R extends CheckpointRecord> {
  /** The server's name in the stack file; also its checkpoint instance. */
  name: string;
  kind: ServerKind;
  /** Undefined when checkpointing is off: no control routes, no participant. */
  checkpoint: CheckpointSettings | undefined;
  participant?: Participant<R>;
  logger?: Logger;
  plane?: Omit<
    ControlPlaneOptions,
    'leaseGraceSeconds' | 'logger' | 'signingKey' | 'fileMode' | 'dirMode'
  >;
}

export interface GymApp<R extends CheckpointRecord> {
  readonly app: Express;
  readonly logger: Logger;
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

export function createGymApp<R extends CheckpointRecord>(options: GymAppOptions<R>): GymApp<R> {
  const logger = options.logger ?? createLogger({ server: options.name, kind: options.kind });
  const app = express();
  app.disable('x-powered-by');
  app.set('etag', false);
  const health = healthReply(options.name, options.kind);
  app.get('/health', (_req, res) => {
    res.json(health);
  });

  let plane: ControlPlane<R> | undefined;
  if (options.checkpoint) {
    if (!options.participant) {
      throw new ConfigError(
        `server ${options.name}: checkpointing is on but it has no participant`,
      );
    }
    plane = new ControlPlane(options.participant, {
      ...options.plane,
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

/** Listens on `host:port` (0 picks a free port) and resolves with the bound address. */
export function listen(app: Express, port: number, host = '127.0.0.1'): Promise<ListeningServer> {
  return new Promise((resolve, reject) => {
    const server = createServer(app);
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
            server.close(() => done());
            server.closeIdleConnections();
          }),
      });
    });
  });
}
