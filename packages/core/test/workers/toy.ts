/**
 * A toy kind on the worker layer, for its tests: each worker holds tickets in its own gate (one
 * per in-flight episode, counted by capture key) and exports a record per ticket; the
 * coordinator merges the workers' in-flight keys into one report.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { connect, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { AdmissionGate } from '../../src/admission/gate.js';
import { ControlPlane } from '../../src/control/plane.js';
import { planeTarget } from '../../src/control/routes.js';
import { type EpisodeId, episodeIdFromJson } from '../../src/identity.js';
import type { JsonObject, JsonValue } from '../../src/json.js';
import { type PrepareReport, prepareReport, RetiredMarks } from '../../src/participant.js';
import type { CheckpointRecord } from '../../src/store.js';
import { Channel } from '../../src/workers/channel.js';
import { WorkerCoordinator } from '../../src/workers/coordinator.js';
import { type CoordinatorServer, serveCoordinator } from '../../src/workers/coordinator-server.js';
import type { WorkerReport, WorkerSide } from '../../src/workers/types.js';
import { WorkerLink } from '../../src/workers/worker-link.js';
import { MemoryLogger } from '../support/test-participant.js';
import { onCleanup, socketPath } from './sockets.js';

export class ToyCoordinator extends WorkerCoordinator {
  merge(reports: readonly WorkerReport[]): PrepareReport {
    const keys = [...new Set(reports.flatMap((r) => Object.keys(r.gate.byKey)))].sort();
    return prepareReport({ blockers: keys, blockerCount: keys.length });
  }

  async export(scope: readonly EpisodeId[] | null): Promise<CheckpointRecord[]> {
    const replies = await this.broadcast('export', { all: scope === null });
    return [...replies.values()].flatMap((r) => r as unknown as CheckpointRecord[]);
  }

  validateRecord(record: JsonObject): CheckpointRecord {
    return { episode_id: episodeIdFromJson(record.episode_id) };
  }

  async install(): Promise<void> {
    await this.broadcast('install', {});
  }

  restoredPending(): EpisodeId[] {
    return [];
  }
}

/** One toy worker: its side (gate, marks, hooks the test may replace) and its link. */
export interface ToyWorker {
  readonly side: WorkerSide & { gate: AdmissionGate; marks: RetiredMarks };
  readonly link: WorkerLink;
  /** Set once the link lost its coordinator. */
  readonly lost: { value: boolean };
}

export interface Toy {
  readonly coordinator: ToyCoordinator;
  readonly plane: ControlPlane;
  readonly server: CoordinatorServer;
  readonly logger: MemoryLogger;
  readonly checkpointRoot: string;
  worker(index: number, hooks?: Partial<WorkerSide>): Promise<ToyWorker>;
  /** A worker speaking the protocol by hand over its own connection, which the test can drop. */
  rawWorker(index: number, before?: (kind: string) => Promise<void>): Promise<RawWorker>;
}

export interface RawWorker {
  readonly channel: Channel;
  readonly socket: Socket;
}

/** A coordinator for `expectedWorkers`, its plane (real clock) and its socket server. */
export async function startToy(expectedWorkers: number): Promise<Toy> {
  const logger = new MemoryLogger();
  const coordinator = new ToyCoordinator({
    kind: 'resources',
    instance: 'toy',
    expectedWorkers,
    logger,
  });
  const plane = new ControlPlane(coordinator, { leaseGraceSeconds: 60, logger });
  const path = socketPath();
  const server = await serveCoordinator(coordinator, planeTarget(plane), path, logger);
  const checkpointRoot = mkdtempSync(join(tmpdir(), 'cg-toy-'));
  const links: WorkerLink[] = [];
  onCleanup(async () => {
    for (const link of links) await link.detach();
    plane.dispose();
    await server.close();
    rmSync(checkpointRoot, { recursive: true, force: true });
  });
  const worker = async (index: number, hooks: Partial<WorkerSide> = {}): Promise<ToyWorker> => {
    const gate = new AdmissionGate();
    const lost = { value: false };
    const side = {
      gate,
      marks: new RetiredMarks(),
      handle: async (kind: string): Promise<JsonValue> => {
        if (kind === 'export') {
          return [...gate.tickets()].map((t) => ({ episode_id: t.episode! }) as never);
        }
        return {};
      },
      ...hooks,
    };
    const link = new WorkerLink({
      socketPath: path,
      index,
      logger,
      label: 'toy',
      onCoordinatorLost: () => (lost.value = true),
    });
    links.push(link);
    await link.attach(side);
    return { side, link, lost };
  };
  const rawWorker = async (
    index: number,
    before: (kind: string) => Promise<void> = async () => {},
  ): Promise<RawWorker> => {
    const socket = connect(path);
    await new Promise<void>((resolve) => socket.once('connect', () => resolve()));
    onCleanup(() => void socket.destroy());
    const gate = new AdmissionGate();
    let seq = 0;
    const channel = new Channel(socket, {
      handler: async (kind) => {
        await before(kind);
        if (kind === 'close') gate.close();
        if (kind === 'open') gate.open();
        seq += 1;
        return kind === 'close' ? { seq, report: { gate: gate.snapshot(), extra: {} } } : {};
      },
    });
    await channel.call('join', { index, pid: 90000 + index, extra: {} });
    return { channel, socket };
  };
  return { coordinator, plane, server, logger, checkpointRoot, worker, rawWorker };
}

/** Resolves once `predicate` holds (checked every 10 ms); rejects after `limitMs` (no timing assertion: a bound so a failing test ends). */
export async function eventually(predicate: () => boolean, limitMs = 20_000): Promise<void> {
  const end = Date.now() + limitMs;
  while (!predicate()) {
    if (Date.now() > end) throw new Error('the condition never held');
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

export const now = (): number => Date.now() / 1000;
