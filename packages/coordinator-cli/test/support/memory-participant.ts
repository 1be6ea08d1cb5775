/**
 * A tiny in-memory participant for CLI tests: episodes a test starts, which park as soon as
 * admission closes (unless `stuck`), restarts, restored state, and retire. As an environment it
 * lists its episodes in its status the way the CLI's scope rule expects (`episodes`,
 * `restored_pending`).
 */
import {
  captureKey,
  covers,
  type EpisodeId,
  type JsonObject,
  nextAttempt,
  parseCaptureKey,
} from '@ckpt-gym/core/protocol';
import {
  type AdmissionRequest,
  BaseParticipant,
  type CheckpointRecord,
  type ParticipantKind,
  type PrepareReport,
  prepareReport,
} from '@ckpt-gym/core/server';

export interface MemoryRecord extends CheckpointRecord {
  payload: string;
}

type State = 'running' | 'parked' | 'restart';

export class MemoryParticipant extends BaseParticipant<MemoryRecord> {
  admissionOpen = true;
  /** Running episodes never park: a prepare misses its deadline. */
  stuck = false;
  /** Thrown by closeAdmission: a prepare that fails on this participant. */
  closeError: Error | null = null;
  /** False: the status does not list episodes (an environment participant without the contract). */
  listsEpisodes = true;
  readonly episodes = new Map<string, { episode: EpisodeId; state: State }>();
  readonly restored = new Map<string, EpisodeId>();
  readonly retired: string[] = [];
  parkExportedCalls = 0;
  /** Merged into the status reply: what a coordinator of several workers adds (`workers`, …). */
  statusFields: Record<string, unknown> = {};
  #carried: ReadonlySet<string> = new Set();

  constructor(kind: ParticipantKind, instance: string) {
    super(kind, instance);
  }

  start(key: string, state: State = 'running'): void {
    this.episodes.set(key, { episode: parseCaptureKey(key), state });
    this.notifyChange();
  }

  #blockers(): string[] {
    return [...this.episodes]
      .filter(([key, live]) => live.state === 'running' && !this.#carried.has(key))
      .map(([key]) => key);
  }

  async closeAdmission(request: AdmissionRequest): Promise<void> {
    if (this.closeError) throw this.closeError;
    this.admissionOpen = false;
    this.#carried = request.carriedRestarts;
    if (!this.stuck) {
      for (const live of this.episodes.values())
        if (live.state === 'running') live.state = 'parked';
    }
    this.notifyChange();
  }

  async openAdmission(): Promise<void> {
    this.admissionOpen = true;
    this.#carried = new Set();
    for (const live of this.episodes.values()) if (live.state === 'parked') live.state = 'running';
  }

  ready(): boolean {
    return this.#blockers().length === 0;
  }

  readiness(): PrepareReport {
    const blockers = this.#blockers();
    return prepareReport({
      blockers,
      blockerCount: blockers.length,
      counts: { episodes: this.episodes.size, restored: this.restored.size },
      restarts: [...this.episodes].filter(([, l]) => l.state === 'restart').map(([key]) => key),
    });
  }

  async export(scope: readonly EpisodeId[] | null): Promise<MemoryRecord[]> {
    const inScope = (key: string) => scope === null || scope.some((e) => captureKey(e) === key);
    const records: MemoryRecord[] = [];
    for (const [key, live] of this.episodes) {
      if (live.state === 'parked' && inScope(key)) {
        records.push({ episode_id: live.episode, payload: `${this.instance}:${key}` });
      }
    }
    for (const [key, episode] of this.restored) {
      if (inScope(key)) records.push({ episode_id: episode, payload: `${this.instance}:${key}` });
    }
    return records;
  }

  validateRecord(record: JsonObject): MemoryRecord {
    if (typeof record.payload !== 'string') throw new Error('record has no payload');
    return record as unknown as MemoryRecord;
  }

  async install(records: MemoryRecord[]): Promise<void> {
    for (const record of records) {
      const replacement = nextAttempt(record.episode_id);
      this.restored.set(captureKey(replacement), replacement);
    }
  }

  restoredPending(): EpisodeId[] {
    return [...this.restored.values()];
  }

  async retire(episode: EpisodeId): Promise<void> {
    this.retired.push(captureKey(episode));
    for (const [key, live] of this.episodes)
      if (covers(episode, live.episode)) this.episodes.delete(key);
    for (const [key, restored] of this.restored)
      if (covers(episode, restored)) this.restored.delete(key);
    this.notifyChange();
  }

  override async parkExported(): Promise<void> {
    this.parkExportedCalls += 1;
  }

  override statusExtra(): Record<string, unknown> {
    if (this.kind !== 'environment' || !this.listsEpisodes) return this.statusFields;
    return {
      ...this.statusFields,
      episodes: [...this.episodes.keys()].sort(),
      restored_pending: [...this.restored.keys()].sort(),
    };
  }
}
