/**
 * The participant of a policy model server with several workers (`num_workers > 1`), in the
 * primary process, on core's worker-coordination layer. It owns what is the server's as a whole:
 * the capture ledger's export and install (the ledger files are on shared disk), the restored cuts
 * and the restored attempts. Each worker owns its gate (admission, tickets, held responses) and
 * its own cut round, and reports them (`worker.ts`).
 *
 * - The commit's export asks every worker for its snapshot (undelivered calls, kept cuts, and
 *   the bytes of the in-scope ledgers it appended, so the coordinator reads only the ledgers no
 *   worker handed and handles no row's text): one lost since admission closed, or fewer
 *   answering than expected, fails the export — final for the checkpoint (core's commit work
 *   keeps the failure).
 * - Once it is ready with admission closed, it asks every worker for its pre-snapshot (every
 *   ledger it appended), so the bulk of the ledgers' bytes crosses before the commit; the
 *   commit's snapshots then hand only what changed since. Without a pre-snapshot (it failed, or
 *   is of an earlier generation) a worker's snapshot hands everything, as before.
 * - A worker claims a restored cut (`claim_cut`) and reports a restored attempt started
 *   (`started`) and its first call (`served`) as immediate messages, answered before any later
 *   message of that worker.
 * - Restore is refused once any worker served a call or any worker left.
 */
import {
  captureKey,
  CheckpointError,
  type EpisodeId,
  type JsonObject,
  type JsonValue,
  nextAttempt,
} from '@ckpt-gym/core/protocol';
import {
  type AdmissionRequest,
  type Logger,
  type PrepareReport,
  WorkerCoordinator,
  type WorkerInfo,
  type WorkerReport,
  type WorkerStatus,
  type WithBytes,
} from '@ckpt-gym/core/server';

import { parseCutRecord } from './cuts.js';
import { CaptureLedger } from './ledger.js';
import {
  checkedScope,
  exportModelRecords,
  installLedgers,
  type ModelRecord,
  restoredCuts,
  stagingKeysReply,
  validateModelRecord,
  validateRawModelRecord,
} from './participant.js';
import {
  checkSnapshots,
  HandedLedgers,
  mergePolicyReports,
  mergeSnapshots,
  type PolicyWorkerReport,
  type Presnapshot,
  presnapshotOf,
  RestoredAttempts,
  RestoredCuts,
  restoreRefusal,
  snapshotOf,
} from './worker-rules.js';

/** The kind messages between a policy worker and its coordinator. */
export const POLICY_MESSAGES = {
  /** Worker → coordinator, immediate: hand me the restored cut of this key, if you hold it. */
  claimCut: 'claim_cut',
  /** Worker → coordinator, immediate: my call did not use this claimed cut; keep it. */
  returnCut: 'return_cut',
  /** Worker → coordinator, immediate: a call of this restored attempt was admitted here. */
  started: 'started',
  /** Worker → coordinator, immediate: this worker admitted its first call. */
  served: 'served',
  /** Coordinator → worker: what you hold (admission is closed). */
  snapshot: 'snapshot',
  /** Coordinator → worker, once ready with admission closed: the ledgers you appended. */
  presnapshot: 'presnapshot',
} as const;

export interface PolicyCoordinatorOptions {
  readonly instance: string;
  readonly expectedWorkers: number;
  /** The shared capture-ledger directory, when token capture is on. */
  readonly ledgerDir: string | undefined;
  /** Generation cuts are on: restored cuts are kept for the workers to claim. */
  readonly generationCuts: boolean;
  readonly logger?: Logger;
}

export class PolicyCoordinator extends WorkerCoordinator<ModelRecord> {
  /** The ledger the workers write; made ready (its directory) once, at start. */
  readonly #ledger: Promise<CaptureLedger> | undefined;
  readonly #cuts = new RestoredCuts();
  readonly #attempts = new RestoredAttempts();
  /** Workers (by index) that admitted any call. */
  readonly #served = new Set<number>();
  /** Workers that had left when admission last closed. */
  #departedAtClose = 0;
  readonly #generationCuts: boolean;
  /** The workers' pre-snapshots of admission generation `generation`, by worker index. */
  #presnapshots: {
    generation: number;
    replies: Promise<Map<number, Presnapshot>>;
  } | null = null;

  constructor(options: PolicyCoordinatorOptions) {
    super({
      kind: 'model',
      instance: options.instance,
      expectedWorkers: options.expectedWorkers,
      label: 'policy',
      ...(options.logger ? { logger: options.logger } : {}),
    });
    this.#ledger =
      options.ledgerDir === undefined ? undefined : new CaptureLedger(options.ledgerDir).init();
    this.#ledger?.catch(() => undefined);
    this.#generationCuts = options.generationCuts;
  }

  // --- the layer's hooks ------------------------------------------------------------------------

  merge(reports: readonly WorkerReport[]): PrepareReport {
    return mergePolicyReports(reports.map((r) => r.extra as unknown as PolicyWorkerReport));
  }

  override joinState(_worker: WorkerInfo): JsonObject {
    // A joining worker has started nothing yet.
    return { restored_keys: this.#cuts.keys(), restored_targets: this.#attempts.joinState() };
  }

  override openState(): JsonObject {
    return { restored_keys: this.#cuts.keys(), restored_targets: this.#attempts.openState() };
  }

  override handleNow(worker: WorkerInfo, kind: string, body: JsonValue): JsonValue | undefined {
    const b = body as JsonObject;
    switch (kind) {
      case POLICY_MESSAGES.claimCut: {
        const record = this.#cuts.claim(String(b.capture_key));
        return { record: record as unknown as JsonObject | null };
      }
      case POLICY_MESSAGES.returnCut:
        this.#cuts.giveBack(
          String(b.capture_key),
          parseCutRecord(b.record as JsonObject),
          (episode) => this.marks.isRetired(episode),
        );
        return {};
      case POLICY_MESSAGES.started:
        this.#attempts.started(String(b.capture_key));
        return {};
      case POLICY_MESSAGES.served:
        this.#served.add(worker.index);
        return {};
      default:
        return undefined;
    }
  }

  override left(index: number): void {
    // Whether the worker started a restored attempt is unknown: none is reported as pending.
    if (this.workers().some((w) => w.index === index)) this.#attempts.workerLeft();
    super.left(index);
  }

  // --- the participant --------------------------------------------------------------------------

  override async closeAdmission(request: AdmissionRequest): Promise<void> {
    this.#departedAtClose = this.departedWorkers;
    await super.closeAdmission(request);
  }

  override async openAdmission(): Promise<void> {
    this.#presnapshots = null;
    await super.openAdmission();
  }

  /** Every change may make it ready: the first time in a closed generation, pre-snapshot. */
  protected override notifyChange(): void {
    super.notifyChange();
    const generation = this.generation;
    if (this.accepting || this.#presnapshots?.generation === generation || !this.ready()) return;
    this.#presnapshots = { generation, replies: this.#askPresnapshots(generation) };
  }

  /**
   * Every worker's pre-snapshot, handed while the prepare's reply and the controller's next calls
   * are under way, and indexed as it arrives; none from a worker that fails to hand a valid one
   * (its commit's snapshot then hands all).
   */
  async #askPresnapshots(generation: number): Promise<Map<number, Presnapshot>> {
    // After the plane's prepare reply, which readiness just released, is on its way.
    await new Promise<void>((resolve) => setImmediate(resolve));
    const started = performance.now();
    let replies: Map<number, JsonValue | WithBytes>;
    try {
      replies = await this.broadcast(POLICY_MESSAGES.presnapshot, { generation });
    } catch (err) {
      this.logger.warn('a policy worker did not hand its pre-snapshot', { error: String(err) });
      return new Map();
    }
    const indexed = new Map<number, Presnapshot>();
    for (const [index, reply] of replies) {
      try {
        indexed.set(index, presnapshotOf(reply));
      } catch (err) {
        this.logger.warn("a policy worker's pre-snapshot is not valid; its commit hands all", {
          worker: index,
          error: String(err),
        });
      }
    }
    const ms = Math.round(performance.now() - started);
    this.logger.debug("the policy workers' pre-snapshots arrived", { ms });
    return indexed;
  }

  async export(scope: readonly EpisodeId[] | null, signal: AbortSignal): Promise<ModelRecord[]> {
    const episodes = checkedScope(scope);
    // Workers are closed, so what they hold is stable: fetch it once.
    const keys = episodes.map((episode) => captureKey(episode));
    const generation = this.generation;
    const pre =
      this.#presnapshots?.generation === generation
        ? await this.#presnapshots.replies
        : new Map<number, Presnapshot>();
    const messages = new Map(
      this.workers().map((w) => [
        w.index,
        {
          kind: POLICY_MESSAGES.snapshot,
          body: pre.has(w.index) ? { keys, presnapshot: generation } : { keys },
        },
      ]),
    );
    const replies = await this.callEach(messages);
    checkSnapshots(
      this.expectedWorkers,
      replies.size,
      this.departedWorkers > this.#departedAtClose,
    );
    const handed = new HandedLedgers();
    const snapshots = [...replies].map(([index, reply]) =>
      snapshotOf(reply, handed, pre.get(index)),
    );
    const { undelivered, cuts } = mergeSnapshots(snapshots, this.#cuts.held);
    const ledger = await this.#ledger;
    return exportModelRecords(ledger, episodes, {
      undelivered,
      cutOf: (key) => cuts.get(key),
      handed,
      signal,
    });
  }

  // Records are checked as the one-process participant checks them.
  readonly validateRecord = validateModelRecord;
  readonly validateRawRecord = validateRawModelRecord;

  override checkRestore(): void {
    const served = new Map<number, boolean>();
    for (const worker of this.workers()) {
      served.set(
        worker.index,
        this.#served.has(worker.index) || worker.report?.gate.served === true,
      );
    }
    const refusal = restoreRefusal({
      workerLeft: this.departedWorkers > 0,
      expected: this.expectedWorkers,
      served,
    });
    if (refusal !== null) throw new CheckpointError(refusal);
  }

  async install(records: ModelRecord[], scope: readonly EpisodeId[]): Promise<void> {
    // Again after admission closed: each worker's close reply says whether it served a call.
    this.checkRestore();
    await installLedgers(await this.#ledger, records, scope);
    if (this.#generationCuts) {
      for (const [target, cut] of restoredCuts(records, scope)) this.#cuts.install(target, cut);
    }
    this.#attempts.installed(scope.map((e) => captureKey(nextAttempt(e))));
  }

  restoredPending(): EpisodeId[] {
    return this.#attempts.pending();
  }

  /**
   * Frees a restored attempt no worker started, without a fence; keeps its ledger if any server
   * sharing it started it. The ledger goes first, so a failed delete leaves the attempt pending.
   */
  override async deleteRestored(episode: EpisodeId): Promise<void> {
    const key = captureKey(episode);
    await (await this.#ledger)?.deleteUnstarted(key);
    this.#attempts.delete(key);
    this.#cuts.drop(key);
  }

  override async retire(episode: EpisodeId): Promise<void> {
    await super.retire(episode);
    this.#cuts.retire(episode);
    this.#attempts.retire(episode);
    // After every worker stopped the attempts' calls, so no late row recreates a ledger.
    await (await this.#ledger)?.retireThrough([episode]);
  }

  /**
   * The layer's status, each worker with its calls in flight and held while a checkpoint is open,
   * and the calls waiting at closed admission (as one process reports them).
   */
  override statusExtra(): Record<string, unknown> {
    const base = super.statusExtra();
    const reports = new Map(this.workers().map((w) => [w.index, w.report]));
    const workers = (base.workers as WorkerStatus[]).map((w) => {
      const report = reports.get(w.index)?.extra as PolicyWorkerReport | undefined;
      return report ? { ...w, inflight: report.inflight, held: report.held } : w;
    });
    let waiting = 0;
    for (const report of reports.values()) {
      if (report) waiting += report.gate.waiting - report.gate.waitingUntagged;
    }
    return {
      ...base,
      workers,
      served: this.#served.size > 0,
      waiting,
      restored_generation_cuts: this.#cuts.keys(),
    };
  }

  override commitReplyExtra(records: ModelRecord[]): Record<string, unknown> {
    return stagingKeysReply(records);
  }
}
