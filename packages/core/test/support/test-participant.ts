/**
 * A participant for control-plane tests: in-memory episodes whose states the test sets
 * (running, parked, restart), hooks that can be made slow (gates), failing or hanging, and
 * counters of every call.
 */
import { RetireIncompleteError } from '../../src/errors.js';
import {
  captureKey,
  covers,
  type EpisodeId,
  nextAttempt,
  parseCaptureKey,
} from '../../src/identity.js';
import type { JsonObject, JsonValue } from '../../src/json.js';
import {
  type AdmissionRequest,
  BaseParticipant,
  type ParticipantKind,
  type PrepareReport,
  prepareReport,
} from '../../src/participant.js';
import type { CheckpointRecord } from '../../src/store.js';
import { Gate, MemoryLogger } from '../../src/testing/index.js';

// Shared with the kit through core (see src/testing/index.ts); re-exported for core's tests.
export { Gate, MemoryLogger };

/** Rejects when `signal` aborts. */
function untilAborted(signal: AbortSignal): Promise<never> {
  return new Promise((_resolve, reject) => {
    const onAbort = () =>
      reject(signal.reason instanceof Error ? signal.reason : new Error('aborted'));
    if (signal.aborted) onAbort();
    else signal.addEventListener('abort', onAbort, { once: true });
  });
}

export interface TestRecord extends CheckpointRecord {
  episode_id: EpisodeId;
  payload: JsonValue;
}

export type EpisodeState = 'running' | 'parked' | 'restart';

interface LiveEpisode {
  readonly episode: EpisodeId;
  state: EpisodeState;
  payload: JsonValue;
}

export interface Calls {
  closeAdmission: number;
  openAdmission: number;
  ready: number;
  readiness: number;
  export: number;
  validate: string[];
  install: number;
  installScopes: string[][];
  retire: string[];
  deleteRestored: string[];
  parkExported: number;
  checkForget: number;
}

export class TestParticipant extends BaseParticipant<TestRecord> {
  admissionOpen = true;
  /** Live episodes by capture key. */
  readonly episodes = new Map<string, LiveEpisode>();
  /** Unclaimed restored state by the replacement attempt's capture key. */
  readonly restored = new Map<string, { episode: EpisodeId; payload: JsonValue }>();
  carried: ReadonlySet<string> = new Set();
  readonly calls: Calls = {
    closeAdmission: 0,
    openAdmission: 0,
    ready: 0,
    readiness: 0,
    export: 0,
    validate: [],
    install: 0,
    installScopes: [],
    retire: [],
    deleteRestored: [],
    parkExported: 0,
    checkForget: 0,
  };
  /** Retires running right now, and the most seen at once. */
  retiresInFlight = 0;
  maxRetiresInFlight = 0;
  deletesInFlight = 0;
  maxDeletesInFlight = 0;

  // Behaviours a test sets.
  exportGate: Gate | null = null;
  exportError: Error | null = null;
  /** Extra records exported regardless of the scope (a misbehaving participant). */
  exportOutside: EpisodeId[] = [];
  lastExportSignal: AbortSignal | null = null;
  installGate: Gate | null = null;
  installError: Error | null = null;
  retireGate: Gate | null = null;
  retireError: Error | null = null;
  deleteGate: Gate | null = null;
  /** How many deleteRestored calls fail before they succeed. */
  deleteFailures = 0;
  closeAdmissionError: Error | null = null;
  /** How many openAdmission calls fail before one succeeds. */
  openAdmissionFailures = 0;
  parkError: Error | null = null;
  restoreRefusal: Error | null = null;
  /** Rollouts whose retired attempts still hold state here (forget is refused for them). */
  readonly holdingState = new Set<string>();
  commitExtra: Record<string, unknown> = {};

  constructor(instance = 'test', kind: ParticipantKind = 'environment') {
    super(kind, instance);
  }

  // --- episodes, as the data plane would drive them ---------------------------------------------

  start(key: string, state: EpisodeState = 'running', payload: JsonValue = { step: 0 }): EpisodeId {
    const episode = parseCaptureKey(key);
    this.episodes.set(key, { episode, state, payload });
    this.notifyChange();
    return episode;
  }

  setState(key: string, state: EpisodeState): void {
    const live = this.episodes.get(key);
    if (!live) throw new Error(`no episode ${key}`);
    live.state = state;
    this.notifyChange();
  }

  parkAll(): void {
    for (const live of this.episodes.values()) if (live.state === 'running') live.state = 'parked';
    this.notifyChange();
  }

  #blockers(): string[] {
    return [...this.episodes]
      .filter(([key, live]) => live.state === 'running' && !this.carried.has(key))
      .map(([key]) => key);
  }

  // --- the participant contract -------------------------------------------------------------------

  async closeAdmission(request: AdmissionRequest): Promise<void> {
    this.calls.closeAdmission += 1;
    if (this.closeAdmissionError) {
      // Closed part way, as on one of several workers, then failed.
      this.admissionOpen = false;
      throw this.closeAdmissionError;
    }
    this.admissionOpen = false;
    this.carried = request.carriedRestarts;
  }

  async openAdmission(): Promise<void> {
    this.calls.openAdmission += 1;
    if (this.openAdmissionFailures > 0) {
      this.openAdmissionFailures -= 1;
      throw new Error('reopening a worker failed');
    }
    this.admissionOpen = true;
    this.carried = new Set();
  }

  ready(): boolean {
    this.calls.ready += 1;
    return this.#blockers().length === 0;
  }

  readiness(): PrepareReport {
    this.calls.readiness += 1;
    const blockers = this.#blockers();
    return prepareReport({
      blockers,
      blockerCount: blockers.length,
      counts: { episodes: this.episodes.size },
      restarts: [...this.episodes]
        .filter(([, live]) => live.state === 'restart')
        .map(([key]) => key),
    });
  }

  async export(scope: readonly EpisodeId[] | null, signal: AbortSignal): Promise<TestRecord[]> {
    this.calls.export += 1;
    this.lastExportSignal = signal;
    if (this.exportGate) await Promise.race([this.exportGate.promise, untilAborted(signal)]);
    if (this.exportError) throw this.exportError;
    const inScope = scope === null ? null : new Set(scope.map(captureKey));
    const records: TestRecord[] = [];
    for (const [key, live] of this.episodes) {
      if (live.state !== 'parked' || this.carried.has(key)) continue;
      if (inScope === null || inScope.has(key))
        records.push({ episode_id: live.episode, payload: live.payload });
    }
    for (const [key, state] of this.restored) {
      if (inScope === null || inScope.has(key))
        records.push({ episode_id: state.episode, payload: state.payload });
    }
    for (const episode of this.exportOutside) records.push({ episode_id: episode, payload: null });
    return records;
  }

  validateRecord(record: JsonObject, key: string): TestRecord {
    this.calls.validate.push(key);
    if (!Object.hasOwn(record, 'payload')) throw new Error('record has no payload');
    return record as unknown as TestRecord;
  }

  override checkRestore(): void {
    if (this.restoreRefusal) throw this.restoreRefusal;
  }

  async install(records: TestRecord[], scope: readonly EpisodeId[]): Promise<void> {
    this.calls.install += 1;
    this.calls.installScopes.push(scope.map(captureKey));
    if (this.installGate) await this.installGate.promise;
    if (this.installError) throw this.installError;
    for (const record of records) {
      const replacement = nextAttempt(record.episode_id);
      this.restored.set(captureKey(replacement), { episode: replacement, payload: record.payload });
    }
  }

  restoredPending(): EpisodeId[] {
    return [...this.restored.values()].map((state) => state.episode);
  }

  override async deleteRestored(episode: EpisodeId): Promise<void> {
    const key = captureKey(episode);
    this.calls.deleteRestored.push(key);
    this.deletesInFlight += 1;
    this.maxDeletesInFlight = Math.max(this.maxDeletesInFlight, this.deletesInFlight);
    try {
      if (this.deleteGate) await this.deleteGate.promise;
      if (this.deleteFailures > 0) {
        this.deleteFailures -= 1;
        throw new Error(`deleting ${key} failed`);
      }
      this.restored.delete(key);
    } finally {
      this.deletesInFlight -= 1;
    }
  }

  async retire(episode: EpisodeId): Promise<void> {
    this.calls.retire.push(captureKey(episode));
    this.retiresInFlight += 1;
    this.maxRetiresInFlight = Math.max(this.maxRetiresInFlight, this.retiresInFlight);
    try {
      if (this.retireGate) await this.retireGate.promise;
      if (this.retireError) throw this.retireError;
      for (const [key, live] of this.episodes)
        if (covers(episode, live.episode)) this.episodes.delete(key);
      for (const [key, state] of this.restored)
        if (covers(episode, state.episode)) this.restored.delete(key);
      this.notifyChange();
    } finally {
      this.retiresInFlight -= 1;
    }
  }

  override async parkExported(_records: TestRecord[]): Promise<void> {
    this.calls.parkExported += 1;
    if (this.parkError) throw this.parkError;
  }

  override checkForget(rolloutIds: readonly string[]): void {
    this.calls.checkForget += 1;
    const holding = rolloutIds.filter((id) => this.holdingState.has(id));
    if (holding.length > 0) {
      throw new RetireIncompleteError(`rollouts still hold retired state: ${holding.join(', ')}`);
    }
  }

  override statusExtra(): Record<string, unknown> {
    return { accepting: this.admissionOpen };
  }

  override commitReplyExtra(_records: TestRecord[]): Record<string, unknown> {
    return this.commitExtra;
  }
}
