/**
 * A `ParticipantCoordinator` over real sockets for the tests: each worker runs a `TestParticipant`
 * behind a `ParticipantWorker`. A record whose payload says `{placed: true}` is not claimed by a
 * request: the test coordinator places it on the worker the payload names (`worker`).
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { ControlPlane } from '../../src/control/plane.js';
import { planeTarget } from '../../src/control/routes.js';
import { type CoordinatorServer, serveCoordinator } from '../../src/workers/coordinator-server.js';
import {
  type CoordinatedRecords,
  ParticipantCoordinator,
} from '../../src/workers/participant-coordinator.js';
import { ParticipantWorker } from '../../src/workers/participant-worker.js';
import { WorkerLink } from '../../src/workers/worker-link.js';
import { MemoryLogger, TestParticipant, type TestRecord } from '../support/test-participant.js';
import { onCleanup, socketPath } from './sockets.js';

interface Placement {
  readonly placed?: boolean;
  readonly worker?: number;
}

const placementOf = (record: TestRecord): Placement =>
  (record.payload ?? {}) as unknown as Placement;

/** Places each `{placed: true}` record on the worker its payload names. */
export class PlacingCoordinator extends ParticipantCoordinator<TestRecord> {
  protected override place(records: readonly TestRecord[]): Map<number, TestRecord[]> {
    const byWorker = new Map<number, TestRecord[]>();
    for (const record of records) {
      const index = placementOf(record).worker ?? 1;
      byWorker.set(index, [...(byWorker.get(index) ?? []), record]);
    }
    return byWorker;
  }
}

export interface ParticipantsWorker {
  readonly participant: TestParticipant;
  readonly side: ParticipantWorker<TestRecord>;
  readonly link: WorkerLink;
}

export interface Participants {
  readonly coordinator: PlacingCoordinator;
  readonly plane: ControlPlane<TestRecord>;
  readonly server: CoordinatorServer;
  readonly socketPath: string;
  readonly checkpointRoot: string;
  worker(index: number): Promise<ParticipantsWorker>;
}

/** What a test may change: the coordinator's records, and each worker's participant. */
export interface ParticipantsOptions {
  readonly records?: CoordinatedRecords<TestRecord>;
  readonly participant?: () => TestParticipant;
}

/** A coordinator for `expectedWorkers`, its plane (real clock) and its socket server. */
export async function startParticipants(
  expectedWorkers: number,
  options: ParticipantsOptions = {},
): Promise<Participants> {
  const logger = new MemoryLogger();
  const records = new TestParticipant('records');
  const coordinator = new PlacingCoordinator({
    kind: 'environment',
    instance: 'env',
    expectedWorkers,
    logger,
    records: options.records ?? {
      validateRecord: (record, key) => records.validateRecord(record, key),
      claimedByRequest: (record) => placementOf(record).placed !== true,
    },
  });
  const plane = new ControlPlane(coordinator, { leaseGraceSeconds: 60, logger });
  const path = socketPath();
  const server = await serveCoordinator(coordinator, planeTarget(plane), path, logger);
  const checkpointRoot = mkdtempSync(join(tmpdir(), 'cg-parts-'));
  const links: WorkerLink[] = [];
  onCleanup(async () => {
    for (const link of links) await link.detach();
    plane.dispose();
    await server.close();
    rmSync(checkpointRoot, { recursive: true, force: true });
  });
  const worker = async (index: number): Promise<ParticipantsWorker> => {
    const participant = options.participant?.() ?? new TestParticipant('env');
    const link = new WorkerLink({
      socketPath: path,
      index,
      logger,
      label: 'environment',
      onCoordinatorLost: () => undefined,
    });
    const side = new ParticipantWorker<TestRecord>(participant, link, logger);
    links.push(link);
    await link.attach(side);
    return { participant, side, link };
  };
  return { coordinator, plane, server, socketPath: path, checkpointRoot, worker };
}
