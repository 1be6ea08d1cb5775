/**
 * The coordinator: in the primary process of a server with several workers, it IS the participant
 * the control plane wraps (phases, lease, storage and replay stay in the plane). It knows its
 * workers by index, closes and reopens their gates, keeps each one's newest report of the current
 * generation, and is ready only when every expected worker reported ready and no worker was lost
 * while admission was closed. A kind subclasses it (`CoordinatorHooks` + the participant's export,
 * install and restored-attempt hooks) and reaches its workers through `broadcast` / `callEach`.
 */
import { CheckpointError, CkptGymError } from '../errors.js';
import { type EpisodeId, episodeIdToJson } from '../identity.js';
import type { JsonObject, JsonValue } from '../json.js';
import { createLogger, type Logger } from '../logging.js';
import {
  type AdmissionRequest,
  BaseParticipant,
  type ParticipantKind,
  type PrepareReport,
} from '../participant.js';
import type { CheckpointRecord } from '../store.js';
import type { Channel } from './channel.js';
import type { WithBytes } from './frames.js';
import { RelayedMarks } from './marks.js';
import {
  type CoordinatorHooks,
  type JoinState,
  MESSAGE_TIMEOUT_MS,
  type NumberedReport,
  type WorkerAdmissionRequest,
  type WorkerInfo,
  type WorkerRegistration,
  type WorkerReport,
  type WorkerStatus,
} from './types.js';
import { readinessOf, replyTimeoutMs, reportKept } from './rules.js';

export interface WorkerCoordinatorOptions {
  readonly kind: ParticipantKind;
  readonly instance: string;
  /** How many workers the primary forks; fewer reported blocks readiness. */
  readonly expectedWorkers: number;
  readonly logger?: Logger;
  /** Names the workers in blockers, errors and logs (default: the kind). */
  readonly label?: string;
}

interface LiveWorker extends WorkerInfo {
  readonly channel: Channel;
  report: WorkerReport | null;
  seq: number;
  /** The worker said it is stopping (a clean stop is not reported as lost). */
  leaving: boolean;
}

/** A worker whose connection closed without a clean stop. */
export interface WorkerLoss {
  readonly index: number;
  readonly pid: number;
  /** Admission was closed for a checkpoint: the loss blocks it. */
  readonly duringCheckpoint: boolean;
}

/** One message per worker, for `callEach`. */
export interface WorkerMessage {
  readonly kind: string;
  readonly body: unknown;
}

export abstract class WorkerCoordinator<R extends CheckpointRecord = CheckpointRecord>
  extends BaseParticipant<R>
  implements CoordinatorHooks
{
  override readonly marks: RelayedMarks;
  readonly expectedWorkers: number;
  protected readonly label: string;
  protected readonly logger: Logger;
  readonly #workers = new Map<number, LiveWorker>();
  #accepting = true;
  #generation = 0;
  #request: AdmissionRequest | null = null;
  /**
   * The workers lost while admission was closed: what they held is unknown, so this checkpoint is
   * blocked; the status names them.
   */
  #lostWhileClosed: { index: number; pid: number }[] = [];
  #onLost: ((loss: WorkerLoss) => void) | undefined;
  #lostWorkers = 0;
  #departedWorkers = 0;
  #readiness: PrepareReport | null = null;

  constructor(options: WorkerCoordinatorOptions) {
    super(options.kind, options.instance);
    this.expectedWorkers = options.expectedWorkers;
    this.label = options.label ?? options.kind;
    this.logger = (
      options.logger ?? createLogger({ server: options.instance, kind: options.kind })
    ).child({ component: 'workers' });
    this.marks = new RelayedMarks({
      mark: (episodes) => this.#relay('mark', { episode_ids: episodes.map(episodeIdToJson) }),
      forget: (rolloutIds) => this.#relay('forget', { rollout_ids: [...rolloutIds] }),
      failed: (what, err) =>
        this.logger.warn(`relaying ${what} to the ${this.label} workers failed`, {
          error: String(err),
        }),
    });
  }

  // --- kind hooks -------------------------------------------------------------------------------

  abstract merge(reports: readonly WorkerReport[]): PrepareReport;

  joinState(_worker: WorkerInfo): JsonObject {
    return {};
  }

  openState(): JsonObject {
    return {};
  }

  handle(_worker: WorkerInfo, kind: string, _body: JsonValue): Promise<unknown> {
    return Promise.reject(new CheckpointError(`unknown checkpoint message ${kind}`));
  }

  handleNow(_worker: WorkerInfo, _kind: string, _body: JsonValue): unknown {
    return undefined;
  }

  // --- what a kind reads ------------------------------------------------------------------------

  get accepting(): boolean {
    return this.#accepting;
  }

  get generation(): number {
    return this.#generation;
  }

  /** The open checkpoint's admission request (a live set of carried restarts), or null. */
  get request(): AdmissionRequest | null {
    return this.#request;
  }

  /** The workers connected now, by index. */
  workers(): WorkerInfo[] {
    return [...this.#workers.values()];
  }

  /** How many workers left since the server started, cleanly or not (none is restarted). */
  get departedWorkers(): number {
    return this.#departedWorkers;
  }

  // --- workers (called by the coordinator's socket server) --------------------------------------

  /** Registers a worker and returns the state it must adopt. */
  join(channel: Channel, registration: WorkerRegistration): JoinState {
    const { index, pid } = registration;
    const worker: LiveWorker = {
      index,
      pid,
      registration,
      channel,
      report: null,
      seq: -1,
      leaving: false,
    };
    this.#workers.set(index, worker);
    this.logger.info(`${this.label} worker ${index} joined`, { worker: index, pid });
    this.notifyChange();
    return {
      accepting: this.#accepting,
      generation: this.#generation,
      request: this.#request ? workerRequest(this.#request) : null,
      // A worker that starts after a retire refuses that attempt's late requests too.
      retired: this.marks.toJson(),
      extra: this.joinState(worker),
    };
  }

  /** The worker said it is stopping: its disconnect is not a loss. */
  leaving(index: number): void {
    const worker = this.#workers.get(index);
    if (worker) worker.leaving = true;
  }

  /** The worker's connection closed. */
  left(index: number): void {
    const worker = this.#workers.get(index);
    if (!worker) return;
    this.#workers.delete(index);
    this.#departedWorkers += 1;
    const meta = { worker: index, pid: worker.pid };
    if (!worker.leaving) this.#lostWorkers += 1;
    if (!this.#accepting) this.#lostWhileClosed.push({ index, pid: worker.pid });
    if (!worker.leaving)
      this.#onLost?.({ index, pid: worker.pid, duringCheckpoint: !this.#accepting });
    const checkpoint = this.#request?.checkpointId;
    const blocks = this.#accepting ? '' : `; it blocks checkpoint ${checkpoint} from committing`;
    if (worker.leaving) {
      this.logger.info(`${this.label} worker ${index} stopped${blocks}`, meta);
    } else if (this.#accepting) {
      this.logger.warn(`${this.label} worker ${index} was lost`, meta);
    } else {
      this.logger.warn(
        `${this.label} worker ${index} was lost during checkpoint ${checkpoint}; ` +
          'it blocks that checkpoint from committing',
        meta,
      );
    }
    this.notifyChange();
  }

  /** A report pushed by a worker; kept only if it is of this generation while admission is closed. */
  receiveReport(index: number, generation: number, numbered: NumberedReport): void {
    const worker = this.#workers.get(index);
    if (!worker) return;
    this.#keep(worker, generation, numbered);
  }

  #keep(worker: LiveWorker, generation: number, numbered: NumberedReport): void {
    const current = { generation: this.#generation, accepting: this.#accepting };
    if (!reportKept(current, { generation, seq: numbered.seq }, worker.seq)) return;
    worker.seq = numbered.seq;
    worker.report = numbered.report;
    this.notifyChange();
  }

  // --- reaching the workers ---------------------------------------------------------------------

  /** Sends every worker the same message at once; see `callEach`. */
  protected broadcast(
    kind: string,
    body: unknown,
    timeoutMs = MESSAGE_TIMEOUT_MS,
  ): Promise<Map<number, JsonValue | WithBytes>> {
    const messages = new Map([...this.#workers.keys()].map((index) => [index, { kind, body }]));
    return this.callEach(messages, timeoutMs);
  }

  /**
   * Sends each worker its own message at once and waits for every reply. Any worker failing
   * fails the call with that worker's status and code, so the controller can act on it.
   */
  protected async callEach(
    messages: ReadonlyMap<number, WorkerMessage>,
    timeoutMs = MESSAGE_TIMEOUT_MS,
  ): Promise<Map<number, JsonValue | WithBytes>> {
    const calls = [...messages].filter(([index]) => this.#workers.has(index));
    const results = await Promise.allSettled(
      calls.map(([index, m]) => this.#workers.get(index)!.channel.call(m.kind, m.body, timeoutMs)),
    );
    const replies = new Map<number, JsonValue | WithBytes>();
    results.forEach((result, i) => {
      const [index, { kind }] = calls[i]!;
      if (result.status === 'fulfilled') {
        replies.set(index, result.value);
        return;
      }
      const err = result.reason as unknown;
      const detail = `${this.label} worker ${index} did not complete ${kind}: ${err instanceof Error ? err.message : String(err)}`;
      throw err instanceof CkptGymError
        ? new CkptGymError(err.code, detail, { cause: err })
        : new CheckpointError(detail, { cause: err });
    });
    return replies;
  }

  async #relay(kind: 'mark' | 'forget', body: JsonObject): Promise<void> {
    await this.broadcast(kind, body);
  }

  // --- the participant --------------------------------------------------------------------------

  async closeAdmission(request: AdmissionRequest): Promise<void> {
    this.#accepting = false;
    this.#generation += 1;
    this.#request = request;
    for (const worker of this.#workers.values()) worker.report = null;
    this.notifyChange();
    // A restore marked the attempts it replaces: every worker refuses them before it closes.
    await this.marks.relayed();
    const generation = this.#generation;
    const timeoutMs = replyTimeoutMs(request.deadlineTs, Date.now());
    const replies = await this.broadcast(
      'close',
      { request: workerRequest(request) as unknown as JsonObject, generation },
      timeoutMs,
    );
    for (const [index, reply] of replies) {
      const worker = this.#workers.get(index);
      if (worker) this.#keep(worker, generation, reply as unknown as NumberedReport);
    }
  }

  async openAdmission(): Promise<void> {
    this.#accepting = true;
    this.#request = null;
    this.#lostWhileClosed = [];
    for (const worker of this.#workers.values()) worker.report = null;
    this.notifyChange();
    try {
      await this.broadcast('open', this.openState());
    } catch (err) {
      // A worker that cannot be reached is gone; none is restarted, and its loss is logged.
      this.logger.warn(`a ${this.label} worker did not acknowledge reopening`, {
        error: String(err),
      });
    }
  }

  ready(): boolean {
    return this.readiness().ready;
  }

  /** Merged once per change (`notifyChange`), since the plane asks after every one. */
  readiness(): PrepareReport {
    if (this.#readiness) return this.#readiness;
    const reports = this.workers().flatMap((w) => (w.report ? [w.report] : []));
    this.#readiness = readinessOf(this.merge(reports), {
      label: this.label,
      expectedWorkers: this.expectedWorkers,
      reported: reports.length,
      lostWhileClosed: this.#lostWhileClosed.length > 0,
    });
    return this.#readiness;
  }

  /** Every change of readiness goes through here: the merged report is made again. */
  protected override notifyChange(): void {
    this.#readiness = null;
    super.notifyChange();
  }

  /** Every worker refuses the attempt (marks relayed) before any of them stops its calls. */
  async retire(episode: EpisodeId): Promise<void> {
    await this.marks.relayed();
    await this.broadcast('retire', { episode_id: episodeIdToJson(episode) });
  }

  override statusExtra(): Record<string, unknown> {
    const workers: WorkerStatus[] = [...this.#workers.values()]
      .sort((a, b) => a.index - b.index)
      .map((w) => ({
        index: w.index,
        pid: w.pid,
        ready: w.report !== null && this.merge([w.report]).ready,
      }));
    return {
      workers,
      expected_workers: this.expectedWorkers,
      lost_workers: this.#lostWorkers,
      lost_during_checkpoint: [...this.#lostWhileClosed],
    };
  }

  /** Calls `listener` for each worker lost (a clean stop is no loss): the primary counts them. */
  onWorkerLost(listener: (loss: WorkerLoss) => void): void {
    this.#onLost = listener;
  }

  /** Releases what the coordinator itself holds; called once the workers stopped. */
  async dispose(): Promise<void> {}
}

/** The admission request as workers get it: plain JSON, restarts as of now. */
function workerRequest(request: AdmissionRequest): WorkerAdmissionRequest {
  return {
    checkpoint_id: request.checkpointId,
    deadline_ts: request.deadlineTs,
    carried_restarts: [...request.carriedRestarts],
  };
}
