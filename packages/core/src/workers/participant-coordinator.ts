/**
 * The coordinator of a server kind whose every worker runs the kind's ordinary one-process
 * participant (environment, agent, resources), each for the work it holds (`ParticipantWorker`).
 * It is the server's participant:
 *
 * - prepare closes every worker and is ready once every worker's participant reports ready
 *   (`mergeReadiness`);
 * - commit asks every worker to export the commit's scope, as bytes it writes undecoded
 *   (`handedRecords`), and adds the restored records no request claimed that the scope names,
 *   exported again as their next attempt;
 * - restore keeps the records whose state lives inside one request (`claimedByRequest`) here, for
 *   the worker that receives the replacement's request to claim (`claim`, an immediate message:
 *   exactly one claim succeeds, none while a checkpoint is open), and hands every other record to
 *   the workers through `place`; every worker installs, even with nothing to install, so each
 *   checks that it holds no live state;
 * - retire reaches every worker and drops the held records of the attempts it covers.
 */
import { AdmissionClosedError, CheckpointError } from '../errors.js';
import {
  captureKey,
  covers,
  type EpisodeId,
  episodeIdFromJson,
  episodeIdToJson,
} from '../identity.js';
import type { JsonObject, JsonValue } from '../json.js';
import type { AdmissionRequest, PrepareReport } from '../participant.js';
import type { CheckpointRecord, RawRecord } from '../store.js';
import {
  WorkerCoordinator,
  type WorkerCoordinatorOptions,
  type WorkerMessage,
} from './coordinator.js';
import { WithBytes } from './frames.js';
import { type HandedRecord, handedRecords, handLines } from './handed-records.js';
import { HeldRecords } from './held.js';
import { checkExportAnswers, mergeReadiness, mergeStatuses, replyTimeoutMs } from './rules.js';
import {
  MESSAGE_TIMEOUT_MS,
  type WorkerInfo,
  type WorkerReport,
  type WorkerStatus,
} from './types.js';

/** The kind messages between a `ParticipantWorker` and its `ParticipantCoordinator`. */
export const PARTICIPANT_MESSAGES = {
  /** Worker → coordinator, immediate: hand me the restored record of this claim key. */
  claim: 'claim',
  /** Coordinator → worker: your participant's records in the commit's scope, and its pending. */
  export: 'export',
  /** Coordinator → worker: install these records (maybe none) under the restore's scope. */
  install: 'install',
  /** Coordinator → worker: free this unclaimed restored attempt (a commit left it out). */
  deleteRestored: 'delete_restored',
} as const;

/**
 * What a kind's records are to the coordinator: the records it restores are checked as its
 * one-process participant checks them; those its workers export are not (they run the same code).
 */
export interface CoordinatedRecords<R extends CheckpointRecord> {
  validateRecord(record: JsonObject, key: string): R;
  validateRawRecord?(record: RawRecord, key: string): R;
  /**
   * True when the record's state lives inside one request: the coordinator holds it, and the
   * worker that receives the replacement attempt's request claims it by that attempt's capture key.
   */
  claimedByRequest(record: R): boolean;
  /**
   * The fields the coordinator reads of a record its workers export (a session kind's
   * `claimedByRequest` and `sessionOf`): such a record is only its `episode_id`, these fields, and
   * its JSON as bytes (`RECORD_FIELDS_JSON`). None unless given.
   */
  readonly exportedFields?: readonly string[];
}

export interface ParticipantCoordinatorOptions<
  R extends CheckpointRecord,
> extends WorkerCoordinatorOptions {
  readonly records: CoordinatedRecords<R>;
}

/** A worker's answer to `export`, with its records' JSON as the reply's bytes. */
export interface WorkerExport {
  readonly records: HandedRecord[];
  /** Its participant's restored attempts no request used yet. */
  readonly pending: JsonValue[];
}

export class ParticipantCoordinator<
  R extends CheckpointRecord = CheckpointRecord,
> extends WorkerCoordinator<R> {
  readonly #records: CoordinatedRecords<R>;
  readonly #held = new HeldRecords<R>();
  /**
   * Each worker's own restored attempts no request used yet, as its last install or export
   * answered: fresh where they matter (a commit deletes the unscoped ones right after its export).
   */
  readonly #workerPending = new Map<number, EpisodeId[]>();
  #departedAtClose = 0;
  /**
   * The line each record a restore read undecoded came from: an install hands the workers these
   * bytes, never re-encoding a record (the coordinator changes none it restores).
   */
  readonly #lines = new WeakMap<CheckpointRecord, Uint8Array>();
  readonly validateRawRecord?: (record: RawRecord, key: string) => R;

  constructor(options: ParticipantCoordinatorOptions<R>) {
    super(options);
    this.#records = options.records;
    const raw = options.records.validateRawRecord;
    if (raw) {
      this.validateRawRecord = (record, key) => {
        const validated = raw.call(options.records, record, key);
        this.#lines.set(validated, record.bytes);
        return validated;
      };
    }
  }

  // --- the layer's hooks ------------------------------------------------------------------------

  merge(reports: readonly WorkerReport[]): PrepareReport {
    return mergeReadiness(reports.map((r) => workerReportOf(r).readiness));
  }

  /** The claim keys held: a worker claims only these, so a request with none costs no message. */
  override joinState(_worker: WorkerInfo): JsonObject {
    return { restored_keys: this.#held.keys() };
  }

  override openState(): JsonObject {
    return { restored_keys: this.#held.keys() };
  }

  /** A claim, answered before any later message to its worker (the next checkpoint's close). */
  override handleNow(worker: WorkerInfo, kind: string, body: JsonValue): JsonValue | undefined {
    if (kind !== PARTICIPANT_MESSAGES.claim)
      return super.handleNow(worker, kind, body) as undefined;
    if (!this.accepting) {
      throw new AdmissionClosedError(`${this.label} admission is closed for a checkpoint`);
    }
    const record = this.#held.claim(String((body as JsonObject).key));
    return { record: (record ?? null) as JsonValue };
  }

  /**
   * Where the records without a claim key go: worker index → its records. The sessions of a
   * resources or native agent server go to the live worker with the least load
   * (`SessionCoordinator` overrides this); any other kind's such record is refused.
   */
  protected place(records: readonly R[]): Map<number, R[]> {
    const [first] = records;
    if (first === undefined) return new Map();
    throw new CheckpointError(
      `${this.label} record of ${captureKey(first.episode_id)} is not claimed by a request, ` +
        `and a ${this.label} server with several workers has no worker to place it on`,
    );
  }

  // --- the participant --------------------------------------------------------------------------

  override async closeAdmission(request: AdmissionRequest): Promise<void> {
    this.#departedAtClose = this.departedWorkers;
    await super.closeAdmission(request);
  }

  validateRecord(record: JsonObject, key: string): R {
    return this.#records.validateRecord(record, key);
  }

  /** Every worker's records in `scope`, and the held records `scope` names, again. */
  async export(scope: readonly EpisodeId[] | null): Promise<R[]> {
    const carried = [...(this.request?.carriedRestarts ?? [])];
    const fields = this.#records.exportedFields ?? [];
    const body = { episode_ids: scope, carried_restarts: carried, exported_fields: fields };
    const replies = await this.broadcast(PARTICIPANT_MESSAGES.export, body);
    checkExportAnswers(this.label, {
      expected: this.expectedWorkers,
      answered: replies.size,
      lostSinceClose: this.departedWorkers > this.#departedAtClose,
    });
    const records: R[] = [];
    for (const [index, reply] of replies) {
      const withBytes = reply instanceof WithBytes;
      const answer = (withBytes ? reply.body : reply) as unknown as WorkerExport;
      const handed = handedRecords(answer.records, withBytes ? reply.bytes : new Uint8Array());
      for (const record of handed) records.push(record as R);
      this.#workerPending.set(
        index,
        answer.pending.map((e) => episodeIdFromJson(e)),
      );
    }
    const inScope = scope === null ? null : new Set(scope.map(captureKey));
    return [...records, ...this.#held.inScope(inScope)];
  }

  /** Refuses a restore over restored records no request claimed yet (as one process does). */
  override checkRestore(): void {
    if (this.#held.size > 0) {
      throw new CheckpointError(
        `${this.label} restore requires a server without unclaimed restored records (${this.#held.size} held)`,
      );
    }
  }

  async install(records: R[], scope: readonly EpisodeId[]): Promise<void> {
    this.checkRestore();
    const held = records.filter((r) => this.#records.claimedByRequest(r));
    const placed = this.place(records.filter((r) => !this.#records.claimedByRequest(r)));
    const body = (index: number): WithBytes => {
      const lines = handLines(placed.get(index) ?? [], (r) => this.#lines.get(r));
      const message = { records: lines.index, scope: scope.map(episodeIdToJson) };
      return new WithBytes(message as unknown as JsonValue, lines.bytes);
    };
    const messages = new Map<number, WorkerMessage>(
      this.workers().map((w) => [
        w.index,
        { kind: PARTICIPANT_MESSAGES.install, body: body(w.index) },
      ]),
    );
    const timeoutMs = this.request
      ? replyTimeoutMs(this.request.deadlineTs, Date.now())
      : MESSAGE_TIMEOUT_MS;
    const replies = await this.callEach(messages, timeoutMs);
    for (const [index, reply] of replies) {
      const pending = (reply as { pending?: JsonValue[] }).pending ?? [];
      this.#workerPending.set(
        index,
        pending.map((e) => episodeIdFromJson(e)),
      );
    }
    this.#held.hold(held);
  }

  /** Held records no request claimed, and each worker's own restored attempts not yet used. */
  restoredPending(): EpisodeId[] {
    const pending = this.#held.pending();
    for (const episodes of this.#workerPending.values()) pending.push(...episodes);
    return pending;
  }

  /** Frees a held record, or asks the worker holding the attempt to free it (no mark raised). */
  override async deleteRestored(episode: EpisodeId): Promise<void> {
    const key = captureKey(episode);
    if (this.#held.claim(key) !== undefined) return;
    for (const [index, episodes] of this.#workerPending) {
      if (!episodes.some((e) => captureKey(e) === key)) continue;
      await this.callEach(
        new Map([
          [index, { kind: PARTICIPANT_MESSAGES.deleteRestored, body: { episode_id: episode } }],
        ]),
      );
      this.#workerPending.set(
        index,
        episodes.filter((e) => captureKey(e) !== key),
      );
    }
  }

  override async retire(episode: EpisodeId): Promise<void> {
    await super.retire(episode);
    this.#held.retire(episode);
    for (const [index, episodes] of this.#workerPending) {
      if (episodes.length === 0) continue;
      this.#workerPending.set(
        index,
        episodes.filter((e) => !covers(episode, e)),
      );
    }
  }

  /**
   * The workers' participants' status as their ready reports gave it (lists unioned, numbers
   * summed: an environment's `episodes`, read after a successful prepare), the layer's with each
   * worker's counts while a checkpoint is open, and the restored attempts pending here and on the
   * workers (`restored_pending`) with the held count.
   */
  override statusExtra(): Record<string, unknown> {
    const base = super.statusExtra();
    const reports = new Map(
      this.workers().map((w) => [w.index, w.report && workerReportOf(w.report)]),
    );
    const statuses = [...reports.values()].flatMap((r) => (r?.status ? [r.status] : []));
    const workers = (base.workers as WorkerStatus[]).map((w) => {
      const report = reports.get(w.index);
      return report ? { ...w, counts: report.readiness.counts } : w;
    });
    return {
      ...mergeStatuses(statuses),
      ...base,
      workers,
      restored_pending: this.restoredPending().map(captureKey).sort(),
      restored_held: this.#held.size,
    };
  }
}

/** What a `ParticipantWorker` reports (`WorkerReport.extra`). */
export interface ParticipantWorkerReport {
  readonly readiness: PrepareReport;
  /** Its participant's status extras, sent once it is ready (its lists are stable then). */
  readonly status?: JsonObject;
}

function workerReportOf(report: WorkerReport): ParticipantWorkerReport {
  return report.extra as unknown as ParticipantWorkerReport;
}
