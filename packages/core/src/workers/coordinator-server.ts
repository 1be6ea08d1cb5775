/**
 * Serves one coordinator to its workers on a Unix socket in the server's runtime directory: one
 * channel per worker, on which the worker joins, reports, forwards control calls to the plane,
 * says it is leaving, and sends its kind's messages.
 */
import { chmod } from 'node:fs/promises';
import { createServer, type Server, type Socket } from 'node:net';

import { InvalidRequestError } from '../errors.js';
import type { Logger } from '../logging.js';
import type { ControlTarget } from '../control/routes.js';
import { CONTROL_ROUTES, type ControlRoute } from '../control/schemas.js';
import { Channel } from './channel.js';
import { WithBytes } from './frames.js';
import type { WorkerCoordinator } from './coordinator.js';
import type { NumberedReport, WorkerInfo, WorkerRegistration } from './types.js';

/**
 * A control call forwarded by a worker: a route (or `status`, or `metrics` for a scrape) and its
 * body as received.
 */
export interface ForwardedControl {
  readonly route: ControlRoute | 'status' | 'metrics';
  readonly body: unknown;
  /** The caller's W3C trace context headers, so the plane's span joins the caller's trace. */
  readonly trace?: Readonly<Record<string, string>>;
}

export interface CoordinatorServer {
  readonly socketPath: string;
  /** Stops accepting and drops every worker's connection. */
  close(): Promise<void>;
}

function isRoute(route: unknown): route is ControlRoute {
  return (CONTROL_ROUTES as readonly unknown[]).includes(route);
}

/** Runs one forwarded control call on the plane; the call ends if the worker's connection does. */
export async function runForwarded(
  target: ControlTarget,
  forwarded: ForwardedControl,
  channel: Channel,
): Promise<unknown> {
  if (forwarded.route === 'status') return target.status();
  if (forwarded.route === 'metrics') return target.metrics?.() ?? [];
  if (!isRoute(forwarded.route)) {
    throw new InvalidRequestError(`unknown control route ${String(forwarded.route)}`);
  }
  const abort = new AbortController();
  channel.onClose(() => abort.abort(new Error('the worker that forwarded this call is gone')));
  const reply = await target.call(forwarded.route, forwarded.body, abort.signal, forwarded.trace);
  // As the HTTP reply's text (what `res.json` writes), which the worker sends as it is.
  return new WithBytes(null, Buffer.from(JSON.stringify(reply)));
}

/** Serves `coordinator` (and `target`, its plane) on `socketPath`; resolves once listening. */
export async function serveCoordinator(
  coordinator: WorkerCoordinator,
  target: ControlTarget,
  socketPath: string,
  logger?: Logger,
): Promise<CoordinatorServer> {
  const sockets = new Set<Socket>();
  const server: Server = createServer((socket) => {
    sockets.add(socket);
    socket.on('close', () => sockets.delete(socket));
    connectWorker(coordinator, target, socket, logger);
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(socketPath, () => {
      server.off('error', reject);
      resolve();
    });
  });
  // Only this user's processes may join (the socket carries control calls).
  await chmod(socketPath, 0o600);
  return {
    socketPath,
    close: () =>
      new Promise<void>((resolve) => {
        for (const socket of sockets) socket.destroy();
        server.close(() => resolve());
      }),
  };
}

function connectWorker(
  coordinator: WorkerCoordinator,
  target: ControlTarget,
  socket: Socket,
  logger: Logger | undefined,
): void {
  let worker: WorkerInfo | undefined;
  const joined = (): WorkerInfo => {
    if (!worker) throw new InvalidRequestError('a worker must join before any other message');
    return worker;
  };
  const channel: Channel = new Channel(socket, {
    peer: 'a worker',
    ...(logger ? { logger } : {}),
    handler: async (kind, body) => {
      switch (kind) {
        case 'join': {
          const registration = body as unknown as WorkerRegistration;
          const state = coordinator.join(channel, registration);
          worker = coordinator.workers().find((w) => w.index === registration.index);
          return state;
        }
        case 'report': {
          const { generation, ...numbered } = body as unknown as NumberedReport & {
            generation: number;
          };
          coordinator.receiveReport(joined().index, generation, numbered);
          return {};
        }
        case 'control':
          return runForwarded(target, body as unknown as ForwardedControl, channel);
        case 'leave':
          coordinator.leaving(joined().index);
          return {};
        default:
          return coordinator.handle(joined(), kind, body);
      }
    },
    immediate: (kind, body) => (worker ? coordinator.handleNow(worker, kind, body) : undefined),
  });
  channel.onClose(() => {
    if (worker) coordinator.left(worker.index);
  });
}
