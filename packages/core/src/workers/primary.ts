/**
 * A server with several workers, on node `cluster`: the primary process makes the runtime
 * directory, runs the coordinator and its plane on a Unix socket there, forks the workers (each
 * re-runs the same argv and listens on the shared port: with port 0, cluster hands every worker
 * the one free port it picked) and, once all of them listen, is the running server: it serves no
 * HTTP itself. A worker that dies is not restarted (a restore is refused once a worker left);
 * closing stops every worker cleanly, then the coordinator.
 */
import cluster, { type Address, type Worker } from 'node:cluster';
import { join } from 'node:path';

import { ControlPlane } from '../control/plane.js';
import { planeTarget } from '../control/routes.js';
import type { Logger } from '../logging.js';
import type { CheckpointSettings, ServerSettings } from '../settings.js';
import { tracingObserver } from '../telemetry/checkpoint-spans.js';
import { GymMetrics, type MetricsJson, metricsObserver } from '../telemetry/metrics.js';
import type { WorkerCoordinator } from './coordinator.js';
import { serveCoordinator } from './coordinator-server.js';
import { createRuntimeDir } from './runtime-dir.js';
import { COORDINATOR_SOCKET_ENV, RUNTIME_DIR_ENV, WORKER_INDEX_ENV } from './types.js';
import { WorkerLink } from './worker-link.js';

/** Where the running server listens: what its listening line prints. */
export interface PrimaryServer {
  readonly host: string;
  readonly port: number;
  readonly url: string;
  readonly coordinator: WorkerCoordinator | undefined;
  /** Stops every worker (SIGTERM: each lets its requests finish), then the coordinator. */
  close(): Promise<void>;
}

export interface StartWorkersOptions {
  readonly settings: ServerSettings;
  readonly checkpoint: CheckpointSettings | undefined;
  /** The coordinator participant, when checkpointing is on. */
  readonly coordinator: WorkerCoordinator | undefined;
  readonly logger: Logger;
}

/** This process is a forked worker of a server with several workers. */
export function isServerWorker(): boolean {
  return cluster.isWorker && process.env[WORKER_INDEX_ENV] !== undefined;
}

/** In a forked worker: its link to the coordinator (undefined when checkpointing is off). */
export function workerLinkFromEnv(logger: Logger, label: string): WorkerLink | undefined {
  const socketPath = process.env[COORDINATOR_SOCKET_ENV];
  const index = Number(process.env[WORKER_INDEX_ENV]);
  if (!socketPath) return undefined;
  return new WorkerLink({ socketPath, index, logger, label });
}

/** In the primary: the coordinator, the workers, and the running server once all listen. */
export async function startWorkers(options: StartWorkersOptions): Promise<PrimaryServer> {
  const { settings, checkpoint, coordinator, logger } = options;
  const dir = createRuntimeDir();
  let stopCoordinator = async (): Promise<void> => {};
  const env: Record<string, string> = { [RUNTIME_DIR_ENV]: dir.path };
  if (checkpoint && coordinator) {
    const metrics = coordinatorMetrics(settings, coordinator);
    const plane = new ControlPlane(coordinator, {
      observers: [metricsObserver(metrics), tracingObserver()],
      leaseGraceSeconds: checkpoint.leaseGraceSeconds,
      signingKey: checkpoint.signingKey,
      fileMode: checkpoint.fileMode,
      dirMode: checkpoint.dirMode,
      logger,
    });
    const socketPath = join(dir.path, 'coordinator.sock');
    const target = { ...planeTarget(plane), metrics: () => metricsToFrame(metrics) };
    const server = await serveCoordinator(coordinator, target, socketPath, logger);
    env[COORDINATOR_SOCKET_ENV] = socketPath;
    stopCoordinator = async () => {
      plane.dispose();
      await server.close();
      await coordinator.dispose();
    };
  }
  try {
    const { workers, port } = await forkWorkers(settings, env, logger);
    const host = settings.host;
    return {
      host,
      port,
      url: `http://${host.includes(':') ? `[${host}]` : host}:${port}`,
      coordinator,
      close: async () => {
        await stopWorkers(workers);
        await stopCoordinator();
        dir.remove();
      },
    };
  } catch (err) {
    await stopCoordinator();
    dir.remove();
    throw err;
  }
}

/**
 * The coordinator's metrics: its plane's operations and events, and the workers it lost. The
 * primary serves no HTTP, so every worker's scrape adds these (`ControlTarget.metrics`): whichever
 * worker a scrape lands on, the server's checkpoint series are the coordinator's, counted once.
 */
function coordinatorMetrics(settings: ServerSettings, coordinator: WorkerCoordinator): GymMetrics {
  const metrics = new GymMetrics({ server: settings.name, kind: settings.kind });
  // From zero, so `increase` sees the first loss.
  metrics.countEvent('worker_lost', {}, 0);
  metrics.countEvent('worker_lost_during_checkpoint', {}, 0);
  coordinator.onWorkerLost((loss) => {
    metrics.countEvent('worker_lost');
    if (loss.duringCheckpoint) metrics.countEvent('worker_lost_during_checkpoint');
  });
  return metrics;
}

/**
 * The coordinator's metrics as a frame may carry them: prom-client's JSON leaves fields undefined
 * (`exemplar`), which the faithful codec refuses; plain JSON drops them (no value is NaN).
 */
async function metricsToFrame(metrics: GymMetrics): Promise<MetricsJson> {
  return JSON.parse(JSON.stringify(await metrics.registry.getMetricsAsJSON())) as MetricsJson;
}

/** Forks `numWorkers` workers and waits until every one listens; one dying first fails the start. */
function forkWorkers(
  settings: ServerSettings,
  env: Record<string, string>,
  logger: Logger,
): Promise<{ workers: Worker[]; port: number }> {
  const workers: Worker[] = [];
  return new Promise((resolve, reject) => {
    let listening = 0;
    let port = 0;
    for (let index = 1; index <= settings.numWorkers; index += 1) {
      const worker = cluster.fork({ ...env, [WORKER_INDEX_ENV]: String(index) });
      workers.push(worker);
      const onListening = (address: Address): void => {
        // A worker's own Unix socket (session routing) is not the server's port.
        if (address.addressType === -1) return;
        worker.off('listening', onListening);
        port = address.port;
        listening += 1;
        if (listening === settings.numWorkers) resolve({ workers, port });
      };
      worker.on('listening', onListening);
      worker.once('exit', (code, signal) => {
        const meta = { worker: index, pid: worker.process.pid, code, signal };
        if (listening < settings.numWorkers) {
          for (const w of workers) if (!w.isDead()) w.process.kill('SIGTERM');
          reject(
            new Error(
              `server ${settings.name}: worker ${index} exited before listening (${code ?? signal})`,
            ),
          );
        } else if (!worker.exitedAfterDisconnect && code !== 0) {
          logger.warn(`server worker ${index} exited; it is not restarted`, meta);
        }
      });
    }
  });
}

/** SIGTERM to every live worker; resolves once all exited. */
async function stopWorkers(workers: readonly Worker[]): Promise<void> {
  await Promise.all(
    workers.map(
      (worker) =>
        new Promise<void>((resolve) => {
          if (worker.isDead()) {
            resolve();
            return;
          }
          worker.once('exit', () => resolve());
          worker.process.kill('SIGTERM');
        }),
    ),
  );
}
