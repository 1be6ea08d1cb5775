/**
 * One worker of a policy model server with several workers: its share of the participant, driven
 * by the coordinator in the primary process (`coordinator.ts`) over core's worker link. The worker
 * owns its gate (admission, tickets, held responses) and its own cut round; it reports what it
 * holds while a checkpoint is open and answers the commit's snapshot.
 *
 * - Once its coordinator is ready it hands the ledgers it appended, as bytes (the pre-snapshot);
 *   its commit snapshot then hands only the in-scope ledgers changed since (`snapshotDelta`), so
 *   the ledgers' bytes cross to the coordinator before the commit, not during it.
 * - Its first admitted call tells the coordinator it served (a restore is then refused).
 * - The first call of a restored attempt marks it started, with the coordinator and in the shared
 *   ledger, before the call runs.
 * - A call that may continue a restored cut claims it from the coordinator before it runs; a
 *   claim that fails (the coordinator unavailable) only costs regeneration. A claimed cut the call
 *   did not use goes back when its ticket leaves; one it used never does.
 */
import type { EpisodeId, JsonObject, JsonValue } from '@ckpt-gym/core/protocol';
import {
  type AdmissionGate,
  type Logger,
  type RetiredMarks,
  type WorkerAdmissionRequest,
  type WorkerSide,
  WithBytes,
} from '@ckpt-gym/core/server';

import { POLICY_MESSAGES } from './coordinator.js';
import type { CutRecord, GenerationCuts } from './cuts.js';
import type { PolicyGate, Ticket } from './gate.js';
import type { CaptureLedger } from './ledger.js';
import {
  handLedgers,
  newestWithin,
  type PolicyWorkerPresnapshot,
  type PolicyWorkerReport,
  type PolicyWorkerSnapshot,
  snapshotDelta,
  WorkerRestoredAttempts,
} from './worker-rules.js';

/**
 * The most a pre-snapshot hands, in characters of row text (128 Mi; ~4.4 M per worker at 8,000
 * rollouts): known ledgers beyond it, the oldest, wait for the commit's scope.
 */
const PRESNAPSHOT_MAX_CHARS = 128 * 1024 * 1024;

/** What the worker needs of its link: kind messages to the coordinator. */
export interface CoordinatorCalls {
  call(kind: string, body: JsonValue): Promise<unknown>;
}

export interface PolicyWorkerOptions {
  readonly policy: PolicyGate;
  readonly link: CoordinatorCalls;
  readonly ledger: CaptureLedger | undefined;
  readonly cuts: GenerationCuts | undefined;
  readonly logger: Logger;
}

export class PolicyWorker implements WorkerSide {
  readonly gate: AdmissionGate;
  readonly marks: RetiredMarks;
  readonly #options: PolicyWorkerOptions;
  readonly #restored = new WorkerRestoredAttempts();
  /** Capture keys the coordinator holds a restored cut for, as of the last join or reopen. */
  #restoredCutKeys = new Set<string>();
  #servedTold = false;
  /** The pre-snapshot handed in admission generation `generation`: each ledger's stamp. */
  #presnapshot: { generation: number; stamps: Map<string, string> } | null = null;

  constructor(options: PolicyWorkerOptions) {
    this.#options = options;
    this.gate = options.policy.admission;
    this.marks = options.policy.marks;
  }

  // --- driven by the coordinator ----------------------------------------------------------------

  adopt(state: JsonObject): void {
    this.#restoredCutKeys = new Set(state.restored_keys as string[]);
    this.#restored.adopt(state.restored_targets as string[] | null);
  }

  /** Closes admission, then runs this worker's cut round (never fails the close). */
  async close(request: WorkerAdmissionRequest): Promise<void> {
    this.#options.policy.close();
    await this.#options.cuts?.cutRound(request.checkpoint_id, request.deadline_ts);
  }

  async open(state: JsonObject): Promise<void> {
    this.#presnapshot = null;
    this.adopt(state);
    this.#options.cuts?.reopened();
    this.#options.policy.open();
  }

  async retire(episode: EpisodeId): Promise<void> {
    await this.#options.policy.retire(episode);
    this.#options.cuts?.retire(episode);
  }

  reportExtra(): JsonObject {
    const { policy, cuts } = this.#options;
    const report: PolicyWorkerReport = {
      streaming: policy.streamingKeys(),
      inflight: policy.inflight,
      held: policy.held,
      ...(cuts ? { cut_failures: cuts.failures, cut_skipped: cuts.skipped } : {}),
    };
    return report as unknown as JsonObject;
  }

  async handle(kind: string, body: JsonValue = {}): Promise<WithBytes> {
    const b = body as { keys?: unknown; generation?: unknown; presnapshot?: unknown };
    switch (kind) {
      case POLICY_MESSAGES.presnapshot:
        // After what is already queued here: the prepare reply this worker may be relaying.
        await new Promise((resolve) => setImmediate(resolve));
        return this.#presnapshotOf(Number(b.generation));
      case POLICY_MESSAGES.snapshot:
        return this.#snapshotOf(Array.isArray(b.keys) ? b.keys.map(String) : [], b.presnapshot);
      default:
        throw new Error(`unknown policy message ${kind}`);
    }
  }

  /**
   * The newest ledgers this worker appended (`PRESNAPSHOT_MAX_CHARS`), as it knows them, handed as
   * bytes beside the JSON; their stamps kept for the commit, which checks each in-scope file then
   * (`snapshotDelta`) and hands the in-scope ones left out.
   */
  #presnapshotOf(generation: number): WithBytes {
    const known = this.#options.ledger?.knownAppended() ?? [];
    const appended = newestWithin(known, PRESNAPSHOT_MAX_CHARS);
    this.#presnapshot = { generation, stamps: new Map(appended.map((l) => [l.key, l.stamp])) };
    const { index, bytes } = handLedgers(appended);
    const presnapshot: PolicyWorkerPresnapshot = { ledgers: index };
    return new WithBytes(presnapshot as unknown as JsonValue, bytes);
  }

  /**
   * The commit's snapshot: undelivered calls, kept cuts, and the ledgers of the asked `keys` this
   * worker appended, handed as bytes beside the JSON (the coordinator reads only the others); only
   * those changed since, when it completes this worker's pre-snapshot of `presnapshot`.
   */
  #snapshotOf(keys: readonly string[], presnapshot: unknown): WithBytes {
    const appended = this.#options.ledger?.appendedNow(keys) ?? [];
    const pre = this.#presnapshot;
    const completes = pre !== null && pre.generation === presnapshot;
    const { changed, dropped } = completes
      ? snapshotDelta(pre.stamps, appended, keys)
      : { changed: appended, dropped: [] };
    const { index, bytes } = handLedgers(changed);
    const snapshot: PolicyWorkerSnapshot = {
      undelivered: [...this.#options.policy.undeliveredCallIds()],
      cuts: this.#options.cuts?.keptCuts() ?? [],
      ledgers: index,
      ...(completes ? { presnapshot: pre.generation, dropped } : {}),
    };
    return new WithBytes(snapshot as unknown as JsonValue, bytes);
  }

  // --- the data plane's hooks -------------------------------------------------------------------

  /** Runs after a call is admitted and before it is dispatched (the proxy's `afterAdmit`). */
  async afterAdmit(ticket: Ticket): Promise<void> {
    if (!this.#servedTold) {
      this.#servedTold = true;
      this.#tell(POLICY_MESSAGES.served, {});
    }
    const key = ticket.captureKey;
    if (key === undefined) return;
    if (this.#restored.take(key)) {
      this.#tell(POLICY_MESSAGES.started, { capture_key: key });
      await this.#options.ledger?.markStarted(key);
    }
    const cuts = this.#options.cuts;
    if (cuts && this.#restoredCutKeys.delete(key)) {
      const record = await this.#claim(key);
      if (record && !cuts.claimed(ticket, record)) this.giveBack(ticket, record);
    }
  }

  /** Gives a claimed cut its call did not use back to the coordinator; a failure is logged. */
  giveBack(ticket: Ticket, record: CutRecord): void {
    const key = ticket.captureKey!;
    this.#restoredCutKeys.add(key);
    this.#tell(POLICY_MESSAGES.returnCut, {
      capture_key: key,
      record: record as unknown as JsonObject,
    });
  }

  async #claim(key: string): Promise<CutRecord | null> {
    try {
      const reply = (await this.#options.link.call(POLICY_MESSAGES.claimCut, {
        capture_key: key,
      })) as { record: CutRecord | null };
      return reply.record;
    } catch (err) {
      this.#options.logger.warn('could not claim the restored cut; the call regenerates', {
        capture_key: key,
        error: (err as Error).message,
      });
      return null;
    }
  }

  /** A message whose reply nobody waits for (it is ordered before this worker's later ones). */
  #tell(kind: string, body: JsonObject): void {
    this.#options.link.call(kind, body).catch((err: unknown) =>
      this.#options.logger.warn(`could not send ${kind} to the policy coordinator`, {
        error: err instanceof Error ? err.message : String(err),
      }),
    );
  }
}
