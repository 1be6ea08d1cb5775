/**
 * Routes each request for a session to the worker that owns it. Every worker of a server with
 * several workers also serves its app on a Unix socket of its own in the server's runtime
 * directory (`<routing id>.sock`); a worker that receives a request for a session another worker
 * owns forwards it there, the body and the reply streamed both ways unchanged (event streams
 * included), and a request that arrived over a worker's own socket is always served there, so a
 * request is forwarded at most once. Generic over how a request names its session (`sessionOf`).
 * docs/workers.md has the choice and its measured cost.
 */
import {
  type Agent,
  type ClientRequest,
  request as httpRequest,
  type IncomingMessage,
  type OutgoingHttpHeaders,
  type RequestListener,
  type Server,
  type ServerResponse,
  createServer,
  Agent as HttpAgent,
} from 'node:http';
import { rmSync } from 'node:fs';
import { join } from 'node:path';

import type { NextFunction, Request, RequestHandler, Response } from 'express';

import { type CkptGymError, OverloadedError, UpstreamError } from '../errors.js';
import { KEEP_ALIVE_IDLE_MS } from '../http-client.js';
import type { JsonObject } from '../json.js';
import type { Logger } from '../logging.js';
import { keepIdleConnections } from '../server.js';
import { accessLogger } from '../telemetry/http.js';
import { REQUEST_ID_HEADER } from '../telemetry/request-id.js';
import {
  isRoutingId,
  type RoutingTables,
  type SessionRef,
  sessionTarget,
} from './session-owners.js';

/** How a request names its session (a signed cookie, a bearer token, …); undefined: none. */
export type SessionOf = (req: IncomingMessage) => SessionRef | undefined;

export interface SessionRouterOptions {
  /** This worker's routing id (`newRoutingId`). */
  readonly routingId: string;
  /** The server's runtime directory, where every worker's socket is. */
  readonly socketDir: string;
  readonly sessionOf: SessionOf;
  readonly logger: Logger;
  /** How long a socket to another worker stays pooled idle (KEEP_ALIVE_IDLE_MS; for tests). */
  readonly forwardIdleMs?: number;
}

/** The routing tables as a coordinator hands them to its workers (join and open state, install). */
export interface RoutingState {
  readonly aliases: Record<string, string>;
  readonly placements: Record<string, string>;
}

/** Marks a request that came over a worker's own socket: it is served there, never forwarded. */
const FORWARDED = Symbol('forwarded to this worker by another');

/** Each hop frames its own connection and body. */
const HOP_BY_HOP = new Set(['connection', 'keep-alive', 'proxy-connection', 'upgrade']);
const REPLY_HOP_BY_HOP = new Set([...HOP_BY_HOP, 'transfer-encoding']);
/** A connect that says the owner's worker is gone: no socket file, or nobody listening on it. */
const GONE = new Set(['ENOENT', 'ECONNREFUSED']);
/** The owner's socket's listen backlog (the kernel caps it at net.core.somaxconn). */
const FORWARD_BACKLOG = 65_535;
/** Connects tried while the owner's backlog is full, 5 ms apart and doubling up to 200 ms. */
const FORWARD_CONNECT_TRIES = 12;

/**
 * Where a forward's time went, in ms from when this worker read the request: when it had a socket
 * to the owner, was connected, had sent the request, and had the owner's reply head; null where
 * it never got that far. `tries`: connects made (more than one when the owner's backlog was full).
 */
interface ForwardTimes {
  socket_ms: number | null;
  connected_ms: number | null;
  sent_ms: number | null;
  reply_ms: number | null;
  tries: number;
}

/** One forward: its owner, its request, when this worker read it, and where its time went. */
interface Forward {
  readonly owner: string;
  readonly req: IncomingMessage;
  readonly start: number;
  readonly times: ForwardTimes;
}

/** Ms since the forward started, for its milestones and its total. */
function elapsedMs(forward: Forward): number {
  return Math.round((performance.now() - forward.start) * 1000) / 1000;
}

/** The fields a forward's log lines share (its path without the query). */
function forwardMeta({ owner, req, times }: Forward): Record<string, unknown> {
  return {
    owner,
    method: req.method,
    path: (req.url ?? '').split('?', 1)[0]!,
    request_id: req.headers[REQUEST_ID_HEADER] ?? null,
    ...times,
  };
}

export function workerSocketPath(socketDir: string, routingId: string): string {
  return join(socketDir, `${routingId}.sock`);
}

/** Raw header pairs without the names in `drop` (lower case), as `writeHead` and `request` take them. */
function withoutHeaders(raw: readonly string[], drop: ReadonlySet<string>): string[] {
  const kept: string[] = [];
  for (let i = 0; i < raw.length; i += 2) {
    if (!drop.has(raw[i]!.toLowerCase())) kept.push(raw[i]!, raw[i + 1]!);
  }
  return kept;
}

/** A reply's headers without hop-by-hop ones; repeated `set-cookie` headers stay separate. */
function replyHeaders(reply: IncomingMessage): OutgoingHttpHeaders {
  const headers: OutgoingHttpHeaders = {};
  for (const [name, value] of Object.entries(reply.headers)) {
    if (!REPLY_HOP_BY_HOP.has(name)) headers[name] = value;
  }
  return headers;
}

function sendError(res: ServerResponse, err: CkptGymError): void {
  const body = JSON.stringify(err.toBody());
  res.writeHead(err.status, {
    'content-type': 'application/json; charset=utf-8',
    'content-length': Buffer.byteLength(body),
  });
  res.end(body);
}

export class SessionRouter {
  readonly routingId: string;
  readonly #options: SessionRouterOptions;
  readonly #aliases = new Map<string, string>();
  #placements = new Map<string, string>();
  readonly #gone = new Set<string>();
  /** One keep-alive pool per owner's socket, for the life of this worker. */
  readonly #agents = new Map<string, Agent>();
  #server: Server | undefined;
  readonly #access: Logger | undefined;

  constructor(options: SessionRouterOptions) {
    if (!isRoutingId(options.routingId)) {
      throw new Error(`not a routing id: ${options.routingId}`);
    }
    this.routingId = options.routingId;
    this.#options = options;
    this.#access = accessLogger(options.logger);
  }

  /** The tables `sessionTarget` resolves by. */
  get tables(): RoutingTables {
    return {
      self: this.routingId,
      aliases: this.#aliases,
      placements: this.#placements,
      gone: this.#gone,
    };
  }

  /**
   * Adopts a restore's tables: aliases accumulate (a cookie may name an owner from any earlier
   * run), placements are replaced (they cover the sessions the last restore placed).
   */
  adopt(state: RoutingState): void {
    for (const [owner, to] of Object.entries(state.aliases)) this.#aliases.set(owner, to);
    this.#placements = new Map(Object.entries(state.placements));
  }

  /** The tables as JSON, for a coordinator's join and open state. */
  static state(
    aliases: ReadonlyMap<string, string>,
    placements: ReadonlyMap<string, string>,
  ): JsonObject {
    return { aliases: Object.fromEntries(aliases), placements: Object.fromEntries(placements) };
  }

  /** The first middleware of the worker's app: forwards what another worker owns, else `next`. */
  middleware(): RequestHandler {
    return (req: Request, res: Response, next: NextFunction) => {
      const forwarded = (req as unknown as Record<symbol, boolean>)[FORWARDED] === true;
      const target = forwarded
        ? undefined
        : sessionTarget(this.#options.sessionOf(req), this.tables);
      if (target === undefined) next();
      else this.#forward(target, req, res, next);
    };
  }

  /** Serves `app` on this worker's own socket, for requests other workers forward here. */
  async listen(app: RequestListener): Promise<void> {
    const path = workerSocketPath(this.#options.socketDir, this.routingId);
    const server = createServer((req, res) => {
      (req as unknown as Record<symbol, boolean>)[FORWARDED] = true;
      app(req, res);
    });
    keepIdleConnections(server);
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      // Exclusive: in a cluster worker the socket is this process's own, not a handle the primary
      // shares (a dead worker's socket then refuses, and nothing passes through the primary).
      // A deep backlog (the kernel caps it at somaxconn): a burst of forwarded connections
      // queues instead of failing with EAGAIN.
      server.listen({ path, exclusive: true, backlog: FORWARD_BACKLOG }, () => {
        server.off('error', reject);
        resolve();
      });
    });
    this.#server = server;
  }

  /** Stops this worker's socket (requests in flight finish) and its pools to other workers. */
  async close(): Promise<void> {
    for (const agent of this.#agents.values()) agent.destroy();
    this.#agents.clear();
    const server = this.#server;
    if (!server) return;
    await new Promise<void>((resolve) => {
      server.close(() => resolve());
      server.closeIdleConnections();
    });
    rmSync(workerSocketPath(this.#options.socketDir, this.routingId), { force: true });
  }

  #agent(owner: string): Agent {
    let agent = this.#agents.get(owner);
    if (!agent) {
      // This side closes idle sockets, well before the owner's server would (SERVER_KEEP_ALIVE_MS):
      // without a timeout node's agent pools them until the owner closes them, and a forward sent
      // on one the owner is closing at that moment fails with ECONNRESET (bursts of them at 16,000
      // rollouts, where a flood's sockets all went idle at once).
      agent = new HttpAgent({
        keepAlive: true,
        timeout: this.#options.forwardIdleMs ?? KEEP_ALIVE_IDLE_MS,
      });
      this.#agents.set(owner, agent);
    }
    return agent;
  }

  /**
   * Streams the request to the owner's socket and its reply back. The body is read only once the
   * owner's socket is connected, so an owner found gone leaves it unread and the request is
   * served here, as a new session would be. Ends with a forward line (ACCESS_LOG_LEVEL) giving
   * where its time went, since the owner's access line starts only when its app sees the request.
   */
  #forward(owner: string, req: IncomingMessage, res: ServerResponse, next: NextFunction): void {
    const forward: Forward = {
      owner,
      req,
      start: performance.now(),
      times: { socket_ms: null, connected_ms: null, sent_ms: null, reply_ms: null, tries: 0 },
    };
    let out: ClientRequest | undefined;
    let servedHere = false;
    res.once('close', () => {
      // The caller went away: so does the forwarded request.
      if (!res.writableFinished) out?.destroy();
      if (!servedHere) this.#forwardLine(forward, res);
    });
    const attempt = (tries: number): void => {
      forward.times.tries = tries + 1;
      out = this.#request(forward, res, {
        // EAGAIN: the owner's listen backlog is full (a burst of connections, thousands of
        // replacements at once). Nothing was sent yet, so connecting again is safe.
        retry: (err) => {
          if (err.code === 'EAGAIN' && tries < FORWARD_CONNECT_TRIES && !res.destroyed) {
            setTimeout(() => attempt(tries + 1), Math.min(5 * 2 ** tries, 200));
            return true;
          }
          return false;
        },
        serveHere: () => {
          servedHere = true;
          next();
        },
      });
    };
    attempt(0);
  }

  /** One try at the owner's socket; `retry` may take a failed connect before anything was sent. */
  #request(
    forward: Forward,
    res: ServerResponse,
    on: {
      readonly retry: (err: NodeJS.ErrnoException) => boolean;
      readonly serveHere: () => void;
    },
  ): ClientRequest {
    const { owner, req, times } = forward;
    const out = httpRequest({
      socketPath: workerSocketPath(this.#options.socketDir, owner),
      agent: this.#agent(owner),
      method: req.method,
      path: req.url,
      headers: withoutHeaders(req.rawHeaders, HOP_BY_HOP) as unknown as Record<string, string>,
    });
    let sent = false;
    const send = (): void => {
      sent = true;
      times.connected_ms = elapsedMs(forward);
      req.pipe(out);
    };
    out.once('socket', (socket) => {
      times.socket_ms = elapsedMs(forward);
      if (socket.connecting) socket.once('connect', send);
      else send();
    });
    out.once('finish', () => {
      times.sent_ms = elapsedMs(forward);
    });
    out.once('response', (reply) => {
      times.reply_ms = elapsedMs(forward);
      res.writeHead(reply.statusCode ?? 502, replyHeaders(reply));
      reply.pipe(res);
      reply.once('error', () => res.destroy());
    });
    out.once('error', (err: NodeJS.ErrnoException) => {
      if (res.headersSent || res.destroyed) {
        // A reply cut short, or a caller gone (its close stopped this forward): nobody to answer.
        res.destroy();
      } else if (!sent && GONE.has(err.code ?? '')) {
        this.#ownerGone(owner, err);
        on.serveHere();
      } else if (!sent && on.retry(err)) {
        return;
      } else {
        this.#options.logger.warn(
          'could not forward a request to the worker that owns its session',
          { ...forwardMeta(forward), error: err.code ?? err.message },
        );
        sendError(
          res,
          err.code === 'EAGAIN'
            ? new OverloadedError(
                `the worker that owns this session is overloaded; retry with backoff`,
              )
            : new UpstreamError(
                `could not reach the worker that owns this session: ${err.message}`,
              ),
        );
      }
    });
    return out;
  }

  /** The forward line of a forward that ended: `aborted` when the caller left before the reply. */
  #forwardLine(forward: Forward, res: ServerResponse): void {
    this.#access?.debug('forward', {
      ...forwardMeta(forward),
      status: res.statusCode,
      ms: elapsedMs(forward),
      ...(res.writableFinished ? {} : { aborted: true }),
    });
  }

  /**
   * Marks `owner` gone and drops its pool. Only its idle sockets are closed: other forwards may
   * still be connecting to it, and each must meet the same refusal and be served here (closing
   * their sockets under them answered them 502).
   */
  #ownerGone(owner: string, err: NodeJS.ErrnoException): void {
    if (this.#gone.has(owner)) return;
    this.#gone.add(owner);
    const agent = this.#agents.get(owner);
    this.#agents.delete(owner);
    for (const idle of Object.values(agent?.freeSockets ?? {})) {
      for (const socket of idle ?? []) socket.destroy();
    }
    this.#options.logger.warn(
      'the worker that owned a session is gone; its sessions are served here as new',
      {
        owner,
        error: err.code,
      },
    );
  }
}
