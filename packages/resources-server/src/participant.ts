/**
 * The resources participant: one per resources server with checkpointing on. It learns each
 * session's lifecycle from the routes that define it (declared session starts, `/close_session`,
 * `/verify`, or a declared end), keyed by the rollout attempt, so no request body is inspected.
 *
 * - `restart_only`: only session starts wait while a checkpoint is open; its rollouts are restarts.
 * - `stateless`: every non-replayable request waits and in-flight work blocks; nothing is exported.
 * - `exported`: as stateless, and sessions are exported, restored and retired through the hooks.
 */
import {
  captureKey,
  CheckpointError,
  CheckpointStateError,
  CkptGymError,
  encodeJson,
  type EpisodeId,
  episodeIdFromJson,
  type JsonObject,
  type JsonValue,
  nextAttempt,
  RetireIncompleteError,
} from '@ckpt-gym/core/protocol';
import {
  AdmissionGate,
  type AdmissionRequest,
  type AdmissionTicket,
  BaseParticipant,
  type CheckpointRecord,
  DEFER_DECODE_MIN_BYTES,
  isRoutingId,
  type GateView,
  isReplayableVerify,
  type Logger,
  type PrepareReport,
  prepareReport,
  type RawRecord,
  RECORD_FIELDS_JSON,
  resourcesAdmission,
  type ResourcesRequestState,
  RetiredMarks,
} from '@ckpt-gym/core/server';

import type { CheckpointMode, Declarations, VerifyMode } from './definition.js';
import { SessionTable, type TrackedSession } from './sessions.js';

/** A record read back undecoded, kept on the record `validateRawRecord` returns. */
const RAW_RECORD: unique symbol = Symbol('resources session record read back undecoded');

export interface ResourcesSessionRecord extends CheckpointRecord {
  episode_id: EpisodeId;
  session_id: string;
  /**
   * The worker the session's cookie and MCP token name (its routing id), on a server with several
   * workers: a restore moves every session of one owner to one worker and aliases the owner there.
   */
  owner?: string;
  state: JsonValue;
  [RAW_RECORD]?: RawRecord;
}

/** How a request relates to its session's lifecycle. */
export type RequestRole = 'start' | 'close' | 'verify' | 'tool';

export interface AdmitRequest {
  readonly role: RequestRole;
  /** A route name for messages. */
  readonly path: string;
  readonly sessionId: string;
  readonly episode: EpisodeId | undefined;
  /** `x-ng-checkpoint-close-follows: 1` on a `/verify`. */
  readonly closeFollows: boolean;
  readonly signal?: AbortSignal;
}

/** An admitted request: apply its outcome once its handler succeeded, release it in every case. */
export interface Admission {
  /** Applies a successful request to the session table (before its reply is sent). */
  succeeded(sessionId: string, endRequested: boolean): void;
  /** Uncounts the request; synchronous, so a cancellation cannot leak a count. */
  release(): void;
}

/** Marks that fence their attempt's sessions the moment they are raised, and unfence on forget. */
class FencingMarks extends RetiredMarks {
  constructor(
    private readonly onMark: (rollouts: ReadonlySet<string>) => void,
    private readonly onForget: (rollouts: readonly string[]) => void,
  ) {
    super();
  }

  override mark(episodes: Iterable<EpisodeId>): number {
    const list = [...episodes];
    const count = super.mark(list);
    this.onMark(new Set(list.map((e) => e.rollout_id)));
    return count;
  }

  override forget(rolloutIds: Iterable<string>): number {
    const list = [...new Set(rolloutIds)];
    const count = super.forget(list);
    this.onForget(list);
    return count;
  }
}

export interface ResourcesParticipantOptions {
  readonly logger?: Logger;
  /** Told when the participant freed a session (retire or restored-state deletion). */
  readonly onSessionFreed?: (sessionId: string) => void;
  /** This worker's routing id, on a server with several workers: the owner its sessions name. */
  readonly owner?: string;
}

/** The gate's tag of a session start (a retire waits for the starts of its attempt). */
const START = 'start';

const RECORD_KEYS = new Set(['episode_id', 'session_id', 'owner', 'state']);

/** Checks a record's keys and session id (its episode and state are read elsewhere). */
function checkedSessionId(key: string, keys: readonly string[], sessionId: unknown): string {
  const extra = keys.filter((k) => !RECORD_KEYS.has(k));
  if (extra.length > 0) {
    throw new CheckpointStateError(`resources record ${key}: unknown keys ${extra.join(', ')}`);
  }
  if (typeof sessionId !== 'string' || sessionId === '') {
    throw new CheckpointStateError(
      `resources record ${key}: session_id must be a non-empty string`,
    );
  }
  if (!keys.includes('state')) {
    throw new CheckpointStateError(`resources record ${key}: state is missing`);
  }
  return sessionId;
}

/** A record's owner: absent, or a routing id. */
function checkedOwner(key: string, owner: unknown): string | undefined {
  if (owner === undefined || isRoutingId(owner)) return owner;
  throw new CheckpointStateError(`resources record ${key}: owner must be a routing id`);
}

/** `owner` as a record's field: none when the session names no owner. */
const ownerField = (owner: string | undefined): { owner?: string } =>
  owner === undefined ? {} : { owner };

/** A restored session's record exported as it was read: its state's bytes, never decoded. */
function undecodedRecord(
  session: TrackedSession,
  owner: string | undefined,
  raw: RawRecord,
): ResourcesSessionRecord {
  const record: ResourcesSessionRecord = {
    episode_id: session.episode,
    session_id: session.id,
    ...ownerField(owner),
    // Decoded only if the store must encode the record itself.
    get state(): JsonValue {
      return raw.field('state')!;
    },
  };
  const ownerJson = owner === undefined ? '' : `"owner":${encodeJson(owner)},`;
  record[RECORD_FIELDS_JSON] = [
    `"session_id":${encodeJson(session.id)},${ownerJson}"state":`,
    raw.fieldBytes('state')!,
  ];
  return record;
}

export class ResourcesParticipant extends BaseParticipant<ResourcesSessionRecord> {
  override readonly marks: RetiredMarks = new FencingMarks(
    (rollouts) => this.#fenceMarked(rollouts),
    (rollouts) => this.#forgetRetired(rollouts),
  );
  readonly mode: CheckpointMode;
  readonly verify: VerifyMode;
  readonly #declarations: Declarations;
  readonly #logger: Logger | undefined;
  readonly #onSessionFreed: ((sessionId: string) => void) | undefined;
  readonly #owner: string | undefined;
  /** The owner each restored session's cookie names (none: checkpointed by one process). */
  readonly #restoredOwners = new Map<string, string | undefined>();
  /**
   * Admission by the resources rule (`resourcesAdmission`): its tickets are the requests that can
   * hold up prepare (a replayable `/verify` has none), tagged by role, by capture key.
   */
  readonly gate = new AdmissionGate();
  readonly #sessions = new SessionTable((key) => {
    for (const listener of this.#restoredLeftListeners) listener(key);
  });
  readonly #restoredLeftListeners = new Set<(key: string) => void>();
  #carried: ReadonlySet<string> = new Set();
  /** Session ids of retired attempts, by rollout, until forget: cookie-only requests are refused. */
  readonly #retiredIds = new Map<string, Set<string>>();
  readonly #retiredRolloutOf = new Map<string, string>();
  /**
   * Restored states read back undecoded, by session id: each is decoded and handed to the
   * restore hook when a request first uses its session (until then it is exported as it was read).
   */
  readonly #undecoded = new Map<string, RawRecord>();
  /** Those being handed to the hook now, so concurrent first requests wait for one install. */
  readonly #installing = new Map<string, Promise<void>>();

  constructor(
    instance: string,
    declarations: Declarations,
    options: ResourcesParticipantOptions = {},
  ) {
    super('resources', instance);
    this.#declarations = declarations;
    this.mode = declarations.mode;
    this.verify = declarations.verify;
    this.#logger = options.logger?.child({ component: 'resources-participant' });
    this.#onSessionFreed = options.onSessionFreed;
    this.#owner = options.owner;
  }

  /**
   * The owner a session's cookie names: the one its record named when a restore installed it
   * (none when checkpointed by one process), else this worker (none in one process).
   */
  ownerOf(sessionId: string): string | undefined {
    return this.#restoredOwners.has(sessionId) ? this.#restoredOwners.get(sessionId) : this.#owner;
  }

  /** True when `sessionId` is tracked and its attempt is not fenced. */
  isOpen(sessionId: string): boolean {
    const session = this.#sessions.get(sessionId);
    return session !== undefined && !session.fenced;
  }

  // --- the data plane -----------------------------------------------------------------------------

  /**
   * Admits one data-plane request by the resources rule: refuses a session start, close or verify
   * without a rollout prefix, waits out an open checkpoint (a replayable `/verify` excepted), then
   * checks the attempt against the session's owner and the retired marks, and counts the request.
   */
  async admit(req: AdmitRequest): Promise<Admission> {
    let session: TrackedSession | undefined;
    const options = {
      episode: req.episode,
      signal: req.signal,
      tag: req.role,
      key: () => (req.episode ? captureKey(req.episode) : (session?.key ?? '')),
      rule: (gate: GateView) => {
        session = this.#sessions.get(req.sessionId);
        return resourcesAdmission(this.#requestState(req, gate.open, session));
      },
    };
    // Runs in the tick of the admission, so no retire sees the session idle in between.
    const claim = <T>(ticket: T): T => {
      if (session) {
        this.#sessions.claim(session);
        session.inflight += 1;
      }
      this.#wake();
      return ticket;
    };
    // A replayable /verify never holds up prepare: it waits for nothing and holds no ticket.
    const ticket: AdmissionTicket | undefined = isReplayableVerify(req.role, this.verify)
      ? await this.gate.pass(options, () => claim(undefined))
      : await this.gate.admit(options, claim);
    const admitted = session;

    let released = false;
    const admission: Admission = {
      succeeded: (sessionId, endRequested) => this.#apply(req, sessionId, endRequested),
      release: () => {
        if (released) return;
        released = true;
        if (ticket) this.gate.leave(ticket);
        if (admitted) admitted.inflight -= 1;
        this.#wake();
      },
    };
    if (admitted !== undefined && this.#undecoded.has(admitted.id)) {
      try {
        await this.#installUndecoded(admitted.id);
      } catch (err) {
        admission.release();
        throw err;
      }
    }
    return admission;
  }

  /**
   * Decodes a restored state and hands it to the restore hook. A state that is not JSON, or that
   * the hook refuses with an untyped error, is `invalid_checkpoint_state` naming its episode, again
   * at each use (never a 500); the state stays as it was read.
   */
  #installUndecoded(sessionId: string): Promise<void> {
    let installing = this.#installing.get(sessionId);
    if (installing === undefined) {
      installing = (async () => {
        const raw = this.#undecoded.get(sessionId)!;
        const state = raw.field('state')!;
        try {
          await this.#declarations.hooks.restoreSessionStates({ [sessionId]: state });
        } catch (err) {
          if (err instanceof CkptGymError) throw err;
          throw new CheckpointStateError(
            `the restored state of resources session '${sessionId}' (episode ` +
              `'${captureKey(raw.episode_id)}') was refused: ${(err as Error).message}`,
            { cause: err },
          );
        }
        this.#undecoded.delete(sessionId);
      })().finally(() => this.#installing.delete(sessionId));
      this.#installing.set(sessionId, installing);
    }
    return installing;
  }

  #requestState(
    req: AdmitRequest,
    open: boolean,
    session: TrackedSession | undefined,
  ): ResourcesRequestState {
    // Field by field: a spread of the request takes V8's slow object-clone path (most of the
    // participant's cost per request).
    return {
      role: req.role,
      path: req.path,
      sessionId: req.sessionId,
      episode: req.episode,
      open,
      mode: this.mode,
      verify: this.verify,
      attemptRetired: req.episode !== undefined && this.marks.isRetired(req.episode),
      sessionRetired: session?.fenced === true || this.#retiredRolloutOf.has(req.sessionId),
      session,
    };
  }

  #apply(req: AdmitRequest, sessionId: string, endRequested: boolean): void {
    if (req.role === 'start') {
      const episode = req.episode as EpisodeId;
      // A seed that finishes after its attempt was marked leaves a retired session, never a live one.
      const fenced = this.marks.isRetired(episode);
      this.#sessions.bind(sessionId, episode, { fenced });
      if (fenced) this.#rememberRetired(sessionId, episode.rollout_id);
    }
    const verifyEnds = req.role === 'verify' && !(this.verify === 'replay' && req.closeFollows);
    if (req.role === 'close' || verifyEnds || endRequested) {
      this.#sessions.remove(sessionId);
      this.#restoredOwners.delete(sessionId);
    }
    this.#wake();
  }

  #rememberRetired(sessionId: string, rolloutId: string): void {
    let ids = this.#retiredIds.get(rolloutId);
    if (!ids) {
      ids = new Set();
      this.#retiredIds.set(rolloutId, ids);
    }
    ids.add(sessionId);
    this.#retiredRolloutOf.set(sessionId, rolloutId);
  }

  /** Called as the control plane raises marks, before anything awaits. */
  #fenceMarked(rollouts: ReadonlySet<string>): void {
    for (const rolloutId of rollouts) {
      const highest = this.marks.highestRetired(rolloutId);
      if (highest === undefined) continue;
      for (const session of this.#sessions.ofRollout(rolloutId, highest)) {
        this.#sessions.fence(session);
        this.#rememberRetired(session.id, rolloutId);
      }
    }
    this.#wake();
  }

  #forgetRetired(rollouts: readonly string[]): void {
    for (const rolloutId of rollouts) {
      for (const id of this.#retiredIds.get(rolloutId) ?? []) this.#retiredRolloutOf.delete(id);
      this.#retiredIds.delete(rolloutId);
    }
  }

  #wake(): void {
    this.notifyChange();
    this.gate.wake();
  }

  // --- admission and readiness ---------------------------------------------------------------------

  async closeAdmission(request: AdmissionRequest): Promise<void> {
    this.#carried = request.carriedRestarts;
    this.gate.close();
    this.#wake();
  }

  async openAdmission(): Promise<void> {
    this.gate.open();
    this.#carried = new Set();
    this.#wake();
  }

  /** In-flight requests that hold up prepare: none in restart_only; carried restarts never. */
  #blockingInflight(): number {
    if (this.mode === 'restart_only') return 0;
    let count = this.gate.inFlight;
    for (const key of this.#carried) count -= this.gate.countOf(key);
    return count;
  }

  ready(): boolean {
    return this.#sessions.fencedCount === 0 && this.#blockingInflight() === 0;
  }

  readiness(): PrepareReport {
    const blockers = new Set<string>();
    for (const ids of this.#retiredIds.values()) {
      for (const id of ids) {
        const session = this.#sessions.get(id);
        if (session?.fenced) blockers.add(session.key);
      }
    }
    if (this.mode !== 'restart_only') {
      for (const [key, count] of this.gate.keys()) {
        // A request that named no attempt on an untracked session is counted, but has no key to list.
        if (count > 0 && key !== '' && !this.#carried.has(key)) blockers.add(key);
      }
    }
    return prepareReport({
      blockers,
      blockerCount: this.#sessions.fencedCount + this.#blockingInflight(),
      counts: {
        inflight: this.gate.inFlight,
        sessions: this.#sessions.size,
        seeds: this.gate.count(START),
        waiting: this.gate.waiting,
      },
      restarts: this.mode === 'restart_only' ? this.#restarts() : [],
    });
  }

  /** Every live session's attempt, and every seed in flight (its reply will say restart). */
  #restarts(): string[] {
    const keys = new Set<string>();
    for (const session of this.#sessions.all()) if (!session.fenced) keys.add(session.key);
    for (const seed of this.gate.tickets(START)) keys.add(seed.key);
    return [...keys].sort();
  }

  // --- export and restore --------------------------------------------------------------------------

  async export(
    scope: readonly EpisodeId[] | null,
    _signal: AbortSignal,
  ): Promise<ResourcesSessionRecord[]> {
    if (this.mode !== 'exported') return [];
    const inScope = scope === null ? null : new Set(scope.map(captureKey));
    const chosen = [...this.#sessions.all()].filter(
      (s) => !s.fenced && !this.#carried.has(s.key) && (inScope === null || inScope.has(s.key)),
    );
    if (chosen.length === 0) return [];
    const asked = chosen.filter((s) => !this.#undecoded.has(s.id)).map((s) => s.id);
    const states =
      asked.length > 0 ? await this.#declarations.hooks.exportSessionStates(asked) : {};
    const records: ResourcesSessionRecord[] = [];
    for (const session of chosen) {
      const raw = this.#undecoded.get(session.id);
      const owner = this.ownerOf(session.id);
      if (raw !== undefined) {
        records.push(undecodedRecord(session, owner, raw));
      } else if (Object.hasOwn(states, session.id)) {
        records.push({
          episode_id: session.episode,
          session_id: session.id,
          ...ownerField(owner),
          state: states[session.id] as JsonValue,
        });
      } else {
        // The server no longer holds it (a failed verification dropped it): it is not new state.
        this.#logger?.warn('session left out of the export; no longer tracked', {
          session_id: session.id,
          episode: session.key,
        });
        this.#sessions.remove(session.id);
      }
    }
    this.#wake();
    return records;
  }

  validateRecord(record: JsonObject, key: string): ResourcesSessionRecord {
    const sessionId = checkedSessionId(key, Object.keys(record), record.session_id);
    let episode: EpisodeId;
    try {
      episode = episodeIdFromJson(record.episode_id);
    } catch (err) {
      throw new CheckpointStateError(`resources record ${key}: ${(err as Error).message}`);
    }
    const owner = checkedOwner(key, record.owner);
    return {
      episode_id: episode,
      session_id: sessionId,
      ...ownerField(owner),
      state: record.state as JsonValue,
    };
  }

  /** Reads the session id now; the state is decoded when a request first uses the session. */
  validateRawRecord(record: RawRecord, key: string): ResourcesSessionRecord {
    if (record.bytes.length < DEFER_DECODE_MIN_BYTES)
      return this.validateRecord(record.decode(), key);
    const sessionId = checkedSessionId(key, record.fieldNames(), record.field('session_id'));
    const owner = checkedOwner(key, record.field('owner'));
    return {
      episode_id: record.episode_id,
      session_id: sessionId,
      ...ownerField(owner),
      get state(): JsonValue {
        return record.field('state')!;
      },
      [RAW_RECORD]: record,
    };
  }

  override checkRestore(): void {
    if (this.gate.served || this.#sessions.size > 0 || this.gate.inFlight > 0) {
      throw new CheckpointError(
        'resources restore requires a process that has not served sessions',
      );
    }
  }

  async install(records: ResourcesSessionRecord[], _scope: readonly EpisodeId[]): Promise<void> {
    if (records.length === 0) return;
    if (this.mode !== 'exported') {
      throw new CheckpointError(`a ${this.mode} resources server cannot restore session state`);
    }
    const states: Record<string, JsonValue> = {};
    const undecoded = new Map<string, RawRecord>();
    for (const record of records) {
      if (Object.hasOwn(states, record.session_id) || undecoded.has(record.session_id)) {
        throw new CheckpointStateError(
          `resources session '${record.session_id}' appears in more than one record`,
        );
      }
      const raw = record[RAW_RECORD];
      if (raw !== undefined) undecoded.set(record.session_id, raw);
      else states[record.session_id] = record.state;
    }
    await this.#declarations.hooks.restoreSessionStates(states);
    for (const record of records) {
      this.#sessions.bind(record.session_id, nextAttempt(record.episode_id), { restored: true });
      this.#restoredOwners.set(record.session_id, record.owner);
    }
    for (const [sessionId, raw] of undecoded) this.#undecoded.set(sessionId, raw);
    this.#wake();
  }

  restoredPending(): EpisodeId[] {
    return this.#sessions.pendingEpisodes();
  }

  /** Calls `listener` with each restored attempt's key as it stops being pending here. */
  onRestoredLeft(listener: (key: string) => void): void {
    this.#restoredLeftListeners.add(listener);
  }

  /** The sessions tracked here, each marked when it is a restored copy no request used yet. */
  sessionCopies(): { id: string; unused: boolean }[] {
    if (this.mode !== 'exported') return [];
    return [...this.#sessions.all()].map((s) => ({ id: s.id, unused: s.pending }));
  }

  /**
   * Frees restored copies no request used, because another worker's copy of the session is live
   * (it was seeded again there); a copy used meanwhile is kept.
   */
  async freeUnused(sessionIds: readonly string[]): Promise<void> {
    const unused = sessionIds.flatMap((id) => {
      const session = this.#sessions.get(id);
      return session?.pending ? [session] : [];
    });
    await this.#freeAll(unused);
  }

  /** Frees the episode's unclaimed restored sessions; refuses nothing later. */
  override async deleteRestored(episode: EpisodeId): Promise<void> {
    await this.#freeAll(this.#sessions.pendingOf(episode));
  }

  // --- retire and forget ---------------------------------------------------------------------------

  /**
   * Waits for admitted seeds of the rollout up to this attempt, drains requests in flight on its
   * sessions, then frees each through `retireSessionState` (every mode). A session stays tracked —
   * blocking, never exported — until it is freed, so a retire cut short leaves it for a retry.
   */
  async retire(episode: EpisodeId): Promise<void> {
    await this.gate.until(() => !this.gate.holds(episode, START));
    const sessions = this.#sessions.ofRollout(episode.rollout_id, episode.attempt);
    for (const session of sessions) {
      this.#sessions.fence(session);
      this.#rememberRetired(session.id, episode.rollout_id);
    }
    this.#wake();
    const tracked = (s: TrackedSession): boolean => this.#sessions.get(s.id) === s;
    await this.gate.until(() => sessions.every((s) => s.inflight === 0 || !tracked(s)));
    await this.#freeAll(sessions.filter(tracked));
  }

  /** Frees each session's state through the hook, then stops tracking it. */
  async #freeAll(sessions: readonly TrackedSession[]): Promise<void> {
    await Promise.all(
      sessions.map(async (session) => {
        await this.#retireState(session);
        this.#free(session);
      }),
    );
    this.#wake();
  }

  /** Frees the session's state through the hook (one the hook never received has nothing to free). */
  async #retireState(session: TrackedSession): Promise<void> {
    if (!this.#undecoded.has(session.id)) {
      await this.#declarations.hooks.retireSessionState(session.id);
    }
  }

  #free(session: TrackedSession): void {
    if (this.#sessions.get(session.id) !== session) return;
    this.#undecoded.delete(session.id);
    this.#restoredOwners.delete(session.id);
    this.#sessions.remove(session.id);
    this.#onSessionFreed?.(session.id);
  }

  override checkForget(rolloutIds: readonly string[]): void {
    const holding: string[] = [];
    for (const rolloutId of rolloutIds) {
      const fenced = this.#sessions
        .ofRollout(rolloutId, Number.MAX_SAFE_INTEGER)
        .filter((s) => s.fenced)
        .map((s) => s.id);
      holding.push(...fenced);
      const highest = this.marks.highestRetired(rolloutId);
      if (
        highest !== undefined &&
        this.gate.holds({ rollout_id: rolloutId, attempt: highest }, START)
      ) {
        holding.push(`a seed of rollout '${rolloutId}'`);
      }
    }
    if (holding.length > 0) {
      throw new RetireIncompleteError(
        `retire has not finished freeing resources sessions ${JSON.stringify(holding.slice(0, 10))}`,
      );
    }
  }

  override statusExtra(): Record<string, unknown> {
    return { mode: this.mode, verify: this.verify, retired_sessions: this.#retiredRolloutOf.size };
  }
}
