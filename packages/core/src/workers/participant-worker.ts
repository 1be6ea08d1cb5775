/**
 * One worker of a server whose every worker runs the kind's one-process participant, driven by a
 * `ParticipantCoordinator` over the worker link: close, open, retire and forget act on the
 * participant; it reports the participant's readiness (and, once ready, its status); it exports
 * and installs on the coordinator's asking; and it claims the restored records the coordinator
 * holds for the participant (`RestoredClaims`), so exactly one worker continues each.
 */
import { AdmissionGate } from '../admission/gate.js';
import { CkptGymError, InvalidPhaseError } from '../errors.js';
import { captureKey, type EpisodeId, episodeIdFromJson, episodeIdToJson } from '../identity.js';
import type { JsonObject, JsonValue } from '../json.js';
import type { Logger } from '../logging.js';
import type { Participant, RetiredMarks } from '../participant.js';
import { type CheckpointRecord, rawRecordOf } from '../store.js';
import { WithBytes } from './frames.js';
import { type HandedRecord, handedLines, handRecords } from './handed-records.js';
import {
  PARTICIPANT_MESSAGES,
  type ParticipantWorkerReport,
  type WorkerExport,
} from './participant-coordinator.js';
import type { WorkerAdmissionRequest, WorkerSide } from './types.js';

/** A participant's way to the restored records its worker's coordinator holds. */
export interface RestoredClaims<R extends CheckpointRecord = CheckpointRecord> {
  /**
   * True when the coordinator may hold a restored record for `key` (a replacement attempt's
   * capture key), as of this worker's last join or reopen: claim it before running the request.
   */
  holds(key: string): boolean;
  /**
   * Claims the record: it is this worker's from here on (naming the attempt it replaces), or null
   * when another worker claimed it first. Refused with `admission_closed` while a checkpoint is
   * open, as a new episode is; a refused claim keeps the key, so a later request claims again.
   */
  claim(key: string): Promise<R | null>;
}

/** What the worker needs of its link: kind messages to the coordinator. */
export interface CoordinatorCalls {
  call(kind: string, body: unknown): Promise<unknown>;
}

export class ParticipantWorker<R extends CheckpointRecord = CheckpointRecord>
  implements WorkerSide, RestoredClaims<R>
{
  /** This worker's admission as the layer sees it: closed and opened with the participant. */
  readonly gate = new AdmissionGate();
  readonly marks: RetiredMarks;
  readonly #participant: Participant<R>;
  readonly #link: CoordinatorCalls;
  readonly #logger: Logger;
  /** Claim keys the coordinator held at this worker's last join or reopen. */
  #heldKeys = new Set<string>();
  /** The open checkpoint's carried restarts, a live set the commit's export adds to. */
  #carried = new Set<string>();

  constructor(participant: Participant<R>, link: CoordinatorCalls, logger: Logger) {
    this.#participant = participant;
    this.#link = link;
    this.#logger = logger;
    this.marks = participant.marks;
  }

  // --- claims -----------------------------------------------------------------------------------

  holds(key: string): boolean {
    return this.#heldKeys.has(key);
  }

  async claim(key: string): Promise<R | null> {
    const reply = (await this.#link.call(PARTICIPANT_MESSAGES.claim, { key })) as {
      record: JsonObject | null;
    };
    this.#heldKeys.delete(key);
    return reply.record && this.#participant.validateRecord(reply.record, key);
  }

  // --- driven by the coordinator ----------------------------------------------------------------

  adopt(state: JsonObject): void {
    this.#heldKeys = new Set(state.restored_keys as string[]);
  }

  async close(request: WorkerAdmissionRequest): Promise<void> {
    this.#carried = new Set(request.carried_restarts);
    await this.#participant.closeAdmission({
      checkpointId: request.checkpoint_id,
      deadlineTs: request.deadline_ts,
      carriedRestarts: this.#carried,
    });
    this.gate.close();
  }

  async open(state: JsonObject): Promise<void> {
    this.adopt(state);
    await this.#participant.openAdmission();
    this.gate.open();
  }

  retire(episode: EpisodeId): Promise<void> {
    return this.#participant.retire(episode);
  }

  /**
   * Forgets the rollouts whose attempts hold nothing here; a rollout whose retired attempt still
   * runs on this worker keeps its mark (a retire cut short), as the participant's check says.
   */
  forget(rolloutIds: readonly string[]): Promise<void> {
    const free = rolloutIds.filter((id) => {
      try {
        this.#participant.checkForget([id]);
        return true;
      } catch (err) {
        this.#logger.warn('a retired attempt still holds state here; its mark stays', {
          rollout_id: id,
          error: err instanceof CkptGymError ? err.detail : String(err),
        });
        return false;
      }
    });
    this.marks.forget(free);
    return Promise.resolve();
  }

  onChange(listener: () => void): () => void {
    return this.#participant.onChange(listener);
  }

  reportExtra(): JsonObject {
    const readiness = this.#participant.readiness();
    const report: ParticipantWorkerReport = readiness.ready
      ? { readiness, status: this.#participant.statusExtra() as JsonObject }
      : { readiness };
    return report as unknown as JsonObject;
  }

  async handle(kind: string, body: JsonValue, bytes?: Uint8Array): Promise<unknown> {
    const b = body as JsonObject;
    switch (kind) {
      case PARTICIPANT_MESSAGES.export:
        return this.#export(b);
      case PARTICIPANT_MESSAGES.install:
        await this.#install(b, bytes ?? new Uint8Array());
        return { pending: this.#pending() };
      case PARTICIPANT_MESSAGES.deleteRestored:
        await this.#participant.deleteRestored(episodeIdFromJson(b.episode_id));
        return {};
      default:
        throw new Error(`unknown checkpoint message ${kind}`);
    }
  }

  /** Its participant's records in scope, as bytes beside their index (`handRecords`). */
  async #export(body: JsonObject): Promise<WithBytes> {
    // The coordinator checked the readiness this worker last reported; it may have regressed.
    if (!this.#participant.ready()) {
      throw new InvalidPhaseError('this worker is no longer ready to commit');
    }
    for (const key of body.carried_restarts as string[]) this.#carried.add(key);
    const ids = body.episode_ids as JsonValue[] | null;
    const scope = ids === null ? null : ids.map((e) => episodeIdFromJson(e));
    const records = await this.#participant.export(scope, new AbortController().signal);
    const { index, bytes } = handRecords(records, body.exported_fields as string[]);
    const answer: WorkerExport = { records: index, pending: this.#pending() };
    return new WithBytes(answer as unknown as JsonValue, bytes);
  }

  /** Reads each handed line as the store reads one, so its participant decodes what it defers. */
  async #install(body: JsonObject, bytes: Uint8Array): Promise<void> {
    const participant = this.#participant;
    const records = handedLines(body.records as unknown as HandedRecord[], bytes).map(
      ({ episode, line }) => {
        const key = captureKey(episode);
        const raw = rawRecordOf(episode, line, key);
        return participant.validateRawRecord
          ? participant.validateRawRecord(raw, key)
          : participant.validateRecord(raw.decode(), key);
      },
    );
    const scope = (body.scope as JsonValue[]).map((e) => episodeIdFromJson(e));
    await this.#participant.install(records, scope);
  }

  #pending(): JsonValue[] {
    return this.#participant.restoredPending().map((e) => episodeIdToJson(e) as JsonValue);
  }
}
