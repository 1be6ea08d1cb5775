/**
 * The agent participant for agents with session hooks. A session is idle, running, or at a
 * boundary; prepare is ready once no activation is between boundaries. Boundaries are recorded as
 * builders and built only if a checkpoint exports them.
 */
import {
  captureKey,
  CheckpointError,
  CheckpointStateError,
  covers,
  type EpisodeId,
  episodeIdFromJson,
  encodeJson,
  InvalidRequestError,
  type JsonObject,
  type JsonValue,
  nextAttempt,
  RetireIncompleteError,
  sameEpisode,
  StaleAttemptError,
} from '@ckpt-gym/core/protocol';
import {
  AdmissionGate,
  type AdmissionRequest,
  agentCloseAdmission,
  BaseParticipant,
  type EpisodeContext,
  EpisodeSteps,
  ENCODE_AHEAD_SETTLE_MS,
  IdleQueue,
  legacyRunAdmission,
  type PrepareReport,
  prepareReport,
  type RawRecord,
  RECORD_FIELDS_JSON,
  RecordedBoundary,
  type Boundary,
  type CheckpointRecord,
  DEFER_DECODE_MIN_BYTES,
  encodeJsonBytes,
  isRoutingId,
  type RestoredClaims,
} from '@ckpt-gym/core/server';

import { restartCall, runSeed, SEED } from './admission.js';
import { RolloutIndex } from './sessions.js';

/** The gate's tag of a direct `/v1/responses` call under a rollout path. */
const DIRECT = 'direct';

export type SessionState = 'idle' | 'running' | 'at_boundary';

/**
 * The record's fields as the store writes them, from JSON mostly encoded ahead: the boundary's
 * (built once per boundary) and the session state's (by object, see `exportAgentSessions`), whose
 * messages the agent may have encoded once as it added them (`appendEncoded`). None when
 * something is not JSON: the store then reports it against the episode. The state comes last, so
 * a restore reads every other field without walking it (`recordOfHead`).
 */
function recordPieces(
  record: Pick<AgentSessionRecord, 'session_key' | 'episode' | 'owner'>,
  sessionJson: () => readonly (string | Uint8Array)[],
  boundaryJson: () => string,
): (string | Uint8Array)[] | undefined {
  const owner = record.owner === undefined ? '' : `"owner":${encodeJson(record.owner)},`;
  try {
    return [
      `"session_key":${encodeJson(record.session_key)},${owner}"boundary":`,
      boundaryJson(),
      `,"episode":${encodeJson(record.episode)},"session":`,
      ...sessionJson(),
    ];
  } catch {
    return undefined;
  }
}

/**
 * `pieces` with each run of texts as one piece of UTF-8 bytes, bytes kept as they are (the same
 * memory): a commit then copies what was encoded ahead instead of encoding text again.
 */
function textsAsBytes(pieces: readonly (string | Uint8Array)[]): Uint8Array[] {
  const out: Uint8Array[] = [];
  let text = '';
  for (const piece of pieces) {
    if (typeof piece === 'string') {
      text += piece;
      continue;
    }
    if (text.length > 0) out.push(Buffer.from(text));
    text = '';
    out.push(piece);
  }
  if (text.length > 0) out.push(Buffer.from(text));
  return out;
}

/** A record's fields encoded ahead, valid while the session's state and boundary JSON are these. */
interface EncodedFields {
  readonly state: object;
  readonly boundary: string;
  readonly pieces: readonly Uint8Array[];
}

export interface RestoredAgentSession {
  readonly sessionKey: string;
  /** The replacement attempt the session is installed under. */
  readonly episode: EpisodeId;
  /**
   * The checkpointed state, decoded when first read: an agent that reads it when the session is
   * first used spares the restore that work. A payload that is not JSON throws
   * `invalid_checkpoint_state` naming the episode.
   */
  readonly session: JsonValue;
}

/** A record read back undecoded, kept on the record `validateRawRecord` returns. */
const RAW_RECORD: unique symbol = Symbol('agent session record read back undecoded');

/** What an agent implements to take part in checkpoints. All hooks are async. */
export interface AgentSessionHooks {
  /**
   * Exports every session of `keys` at once; each key must be answered. Answering an unchanged
   * session with the same object as before lets the participant reuse the JSON it encoded for it
   * (that object must then never change). Parts kept encoded (`encodeOnce`, and lists that only
   * grow, `appendEncoded`) are written as the bytes they already are.
   */
  exportAgentSessions(keys: readonly string[]): Promise<ReadonlyMap<string, JsonValue>>;
  /** Installs restored sessions, all or nothing. */
  restoreAgentSessions(sessions: readonly RestoredAgentSession[]): Promise<void>;
  /** Frees a retired session (and anything it holds outside the process). */
  retireAgentSession(key: string): Promise<void>;
}

export interface AgentSessionRecord extends CheckpointRecord {
  episode_id: EpisodeId;
  session_key: string;
  session: JsonValue;
  /** The loop boundary the session continues from (null: idle, or start the activation over). */
  boundary: JsonObject | null;
  /** A legacy `/run`'s protocol boundary. */
  episode: JsonObject | null;
  /**
   * The worker a native session's cookie names (its routing id), on a server with several
   * workers: a restore moves every session of one owner to one worker and aliases the owner there.
   */
  owner?: string;
  [RAW_RECORD]?: RawRecord;
}

/** The handle an activation's work gets to record its progress. */
export interface ActivationHandle {
  readonly key: string;
  readonly signal: AbortSignal;
  /** The restored boundary this activation continues, or null. */
  readonly continuation: JsonObject | null;
  /** Records a boundary builder; while a checkpoint is open, parks here until resume. */
  boundary(build: () => JsonObject): Promise<void>;
  /**
   * Wraps a model call made right after a boundary: the session counts as at that boundary while
   * it waits, and a reply that arrives while a checkpoint is open is held until resume.
   */
  awaitingModel<T>(call: () => Promise<T>): Promise<T>;
}

class Activation {
  readonly controller = new AbortController();
  cancelled = false;
  readonly done: Promise<void>;
  private finish!: () => void;

  constructor(readonly index: number | null) {
    this.done = new Promise((resolve) => {
      this.finish = resolve;
    });
  }

  end(): void {
    this.finish();
  }

  /** Cancels once: a second canceller (a retire after a close) never interrupts the cleanup. */
  cancel(reason: Error): void {
    if (this.cancelled) return;
    this.cancelled = true;
    this.controller.abort(reason);
  }
}

class Session {
  state: SessionState = 'idle';
  /** The activation's last boundary (a builder). */
  readonly boundary = new RecordedBoundary();
  continuation: JsonObject | null = null;
  restoredPending = false;
  retired = false;
  closing = false;
  activation: Activation | null = null;
  retiring: Promise<void> | null = null;
  /** Set when a legacy `/run` owns the session: its protocol boundary lives in EpisodeSteps. */
  legacy = false;
  /** The restored record, undecoded: while the session is unclaimed, exported as it is. */
  raw: RawRecord | null = null;
  /** The record's fields as UTF-8, encoded ahead of a commit (see `encodedFields`). */
  encoded: EncodedFields | null = null;

  constructor(
    readonly key: string,
    public episode: EpisodeId,
  ) {}

  /** At a boundary: that boundary is exported; otherwise a restored one nothing continued yet. */
  get atBoundary(): boolean {
    return this.state === 'at_boundary' && this.boundary.recorded;
  }

  exportedBoundary(): JsonObject | null {
    return this.atBoundary ? this.boundary.value() : this.continuation;
  }

  exportedBoundaryJson(): string {
    return this.atBoundary ? this.boundary.json() : encodeJson(this.continuation);
  }
}

/** The blocking rule: a session holds up prepare while retired, closing, or between boundaries. */
export function sessionBlocks(s: {
  state: SessionState;
  retired: boolean;
  closing: boolean;
}): boolean {
  return s.retired || s.closing || s.state === 'running';
}

/** Waits for `promise`, or rejects with the signal's reason. */
export function untilSettledOr<T>(
  promise: Promise<T>,
  signal: AbortSignal | undefined,
): Promise<T> {
  if (!signal) return promise;
  if (signal.aborted) return Promise.reject(signal.reason as Error);
  return new Promise<T>((resolve, reject) => {
    const onAbort = () => reject(signal.reason as Error);
    signal.addEventListener('abort', onAbort, { once: true });
    promise.then(
      (v) => {
        signal.removeEventListener('abort', onAbort);
        resolve(v);
      },
      (e: unknown) => {
        signal.removeEventListener('abort', onAbort);
        reject(e as Error);
      },
    );
  });
}

/** Checks a record's fields other than its episode and session state (present: `hasSession`). */
function checkedRecordFields(
  key: string,
  record: { session_key?: unknown; boundary?: unknown; episode?: unknown; owner?: unknown },
  hasSession: boolean,
): Pick<AgentSessionRecord, 'session_key' | 'boundary' | 'episode' | 'owner'> {
  const obj = (v: unknown) => v === null || (typeof v === 'object' && !Array.isArray(v));
  if (typeof record.session_key !== 'string' || record.session_key.length === 0) {
    throw new InvalidRequestError(`${key}: session_key must be a non-empty string`);
  }
  if (!hasSession || !obj(record.boundary ?? null) || !obj(record.episode ?? null)) {
    throw new InvalidRequestError(`${key}: needs session, and boundary/episode objects or null`);
  }
  const { owner } = record;
  if (owner !== undefined && !isRoutingId(owner)) {
    throw new CheckpointStateError(`${key}: owner must be a routing id`);
  }
  return {
    session_key: record.session_key,
    boundary: (record.boundary ?? null) as JsonObject | null,
    episode: (record.episode ?? null) as JsonObject | null,
    ...(owner === undefined ? {} : { owner }),
  };
}

/** A record as the agent participant checks it (the coordinator of several workers checks alike). */
export function agentRecordOf(record: JsonObject, key: string): AgentSessionRecord {
  const episode = episodeIdFromJson(record.episode_id, `${key}.episode_id`);
  return {
    ...checkedRecordFields(key, record, 'session' in record),
    episode_id: episode,
    session: record.session as JsonValue,
  };
}

/**
 * A record read back undecoded, checked as `agentRecordOf` checks it: the session key and the
 * boundaries are decoded now, the session state when first read.
 */
export function agentRecordOfRaw(record: RawRecord, key: string): AgentSessionRecord {
  const fields = checkedRecordFields(
    key,
    {
      session_key: record.field('session_key'),
      boundary: record.field('boundary'),
      episode: record.field('episode'),
      owner: record.field('owner'),
    },
    record.fieldNames().includes('session'),
  );
  return {
    ...fields,
    episode_id: record.episode_id,
    get session(): JsonValue {
      return record.field('session')!;
    },
    [RAW_RECORD]: record,
  };
}

/**
 * A record read back undecoded whose fields other than the state all come ahead of it, as this
 * participant writes them (`recordPieces`): checked as `agentRecordOf` checks it from those fields
 * alone, the state decoded when first read (the whole line, by the native parser: locating the
 * state in JS first would cost more than the few small fields decoded twice). Undefined for a
 * record written in another order.
 */
function recordOfHead(record: RawRecord, key: string): AgentSessionRecord | undefined {
  const head = record.fieldsBefore('session');
  if (head === undefined || !Object.hasOwn(head, 'boundary') || !Object.hasOwn(head, 'episode')) {
    return undefined;
  }
  return {
    ...checkedRecordFields(key, head, true),
    episode_id: record.episode_id,
    get session(): JsonValue {
      return record.decode().session!;
    },
    [RAW_RECORD]: record,
  };
}

/**
 * A record as the coordinator of several workers reads it. A native session is placed by its key
 * and owner, read from the fields ahead of its boundary and its state (this participant writes
 * them first); the rest is read only if asked, checked then as the one-process participant
 * checks it, and the worker it is placed on checks it so. Any other record (a legacy `/run`'s,
 * which stays here until a request claims it) is checked now.
 */
export function placedRecordOfRaw(record: RawRecord, key: string): AgentSessionRecord {
  const whole = (): AgentSessionRecord =>
    recordOfHead(record, key) ?? agentRecordOfRaw(record, key);
  const head = record.fieldsBefore('boundary', 'session') ?? {};
  const sessionKey = head.session_key;
  if (
    typeof sessionKey !== 'string' ||
    sessionKey.length === 0 ||
    isLegacyRecord({ session_key: sessionKey })
  ) {
    return whole();
  }
  const { owner } = head;
  if (owner !== undefined && !isRoutingId(owner)) {
    throw new CheckpointStateError(`${key}: owner must be a routing id`);
  }
  let checked: AgentSessionRecord | undefined;
  const rest = (): AgentSessionRecord => (checked ??= whole());
  return {
    episode_id: record.episode_id,
    session_key: sessionKey,
    ...(owner === undefined ? {} : { owner }),
    get session(): JsonValue {
      return rest().session;
    },
    get boundary(): JsonObject | null {
      return rest().boundary;
    },
    get episode(): JsonObject | null {
      return rest().episode;
    },
    [RAW_RECORD]: record,
  };
}

/** `run:<rollout_id>`: a legacy `/run` is keyed by its logical rollout, so a replacement finds it. */
export function legacyKey(rolloutId: string): string {
  return `run:${rolloutId}`;
}

/** True for a legacy `/run`'s record: its state lives inside one request. */
export function isLegacyRecord(record: Pick<AgentSessionRecord, 'session_key'>): boolean {
  return record.session_key.startsWith('run:');
}

export interface AgentParticipantOptions {
  /** This worker's routing id, on a server with several workers: the owner its sessions name. */
  readonly owner?: string | undefined;
}

export class AgentParticipant extends BaseParticipant<AgentSessionRecord> {
  private readonly sessions = new Map<string, Session>();
  private readonly sessionsByRollout = new RolloutIndex<Session>();
  private readonly blocking = new Set<Session>();
  /** Sessions at a boundary, whose boundary and state are encoded in idle turns ahead of a commit. */
  private readonly encodeAhead = new IdleQueue<Session>(
    async (s) => {
      if (this.sessions.get(s.key) !== s) return;
      s.exportedBoundaryJson();
      const state = (await this.hooks.exportAgentSessions([s.key])).get(s.key);
      if (state === undefined) return;
      if (s.legacy) this.sessionJson(state);
      else this.encodedFields(s, state);
    },
    // Most model calls return long before a checkpoint: only sessions that stay are encoded.
    { settleMs: ENCODE_AHEAD_SETTLE_MS, urgent: () => !this.gate.isOpen },
  );
  /** The JSON of exported session states, by object (see `exportAgentSessions`). */
  private readonly sessionPieces = new WeakMap<object, readonly (string | Uint8Array)[]>();
  /** Seeds and closes wait here while a checkpoint is open; seeds and direct calls are its tickets. */
  readonly gate = new AdmissionGate();
  /** Legacy `/run` protocol steps, keyed `run:<rollout_id>`. */
  readonly steps = new EpisodeSteps({
    onChange: () => this.notifyChange(),
    encodeAheadSettleMs: ENCODE_AHEAD_SETTLE_MS,
  });
  /** Restored legacy protocol boundaries, until their `/run` claims them. */
  private readonly legacyRestored = new Map<string, Boundary | null>();
  private carried: ReadonlySet<string> = new Set();
  /** Restored sessions no request used yet and not retired: `restoredPending`. */
  private readonly unused = new Set<Session>();
  private readonly restoredLeftListeners = new Set<(key: string) => void>();
  /** The owner each restored native session's cookie names (none: checkpointed by one process). */
  private readonly restoredOwners = new Map<string, string | undefined>();
  private readonly owner: string | undefined;
  /**
   * On a worker of a server with several workers: the restored legacy `/run` records its
   * coordinator holds. A replacement `/run` claims its record there before it runs.
   */
  claims: RestoredClaims<AgentSessionRecord> | undefined;

  constructor(
    instance: string,
    private readonly hooks: AgentSessionHooks,
    options: AgentParticipantOptions = {},
  ) {
    super('agent', instance);
    this.owner = options.owner;
  }

  // --- admission ----------------------------------------------------------------------------

  get isAccepting(): boolean {
    return this.gate.isOpen;
  }

  async closeAdmission(request: AdmissionRequest): Promise<void> {
    this.gate.close();
    this.carried = request.carriedRestarts;
    this.steps.close();
    this.encodeAhead.hurry();
  }

  async openAdmission(): Promise<void> {
    this.carried = new Set();
    this.steps.open();
    this.gate.open();
    this.notifyChange();
  }

  /** Resolves once admission is open (at once when it is), or rejects when `signal` aborts. */
  untilOpen(signal?: AbortSignal): Promise<void> {
    return this.gate.waitOpen(signal);
  }

  // --- readiness ----------------------------------------------------------------------------

  private isCarried(episode: EpisodeId): boolean {
    return this.carried.size > 0 && this.carried.has(captureKey(episode));
  }

  /** Cheap: looks only at sessions that block (usually none), never at every session. */
  ready(): boolean {
    if (this.steps.blockerCount() > 0) return false;
    for (const seed of this.gate.tickets(SEED)) if (!this.isCarried(seed.episode!)) return false;
    for (const s of this.blocking) if (this.blocksDespiteCarried(s)) return false;
    return true;
  }

  private blocksDespiteCarried(s: Session): boolean {
    return s.retired || !this.isCarried(s.episode);
  }

  readiness(): PrepareReport {
    const blockers = new Set<string>();
    for (const s of this.blocking)
      if (this.blocksDespiteCarried(s)) blockers.add(captureKey(s.episode));
    for (const seed of this.gate.tickets(SEED)) {
      if (!this.isCarried(seed.episode!)) blockers.add(seed.key);
    }
    // Legacy runs are keyed `run:<rollout>`; report the attempt, as every other blocker.
    for (const key of this.steps.blockers()) {
      const episode = this.sessions.get(key)?.episode;
      blockers.add(episode ? captureKey(episode) : key);
    }
    let atBoundary = 0;
    for (const s of this.sessions.values()) if (s.state === 'at_boundary') atBoundary += 1;
    return prepareReport({
      blockers: [...blockers].sort(),
      blockerCount: blockers.size,
      counts: {
        sessions: this.sessions.size,
        at_boundary: atBoundary,
        seeds: this.gate.count(SEED),
        waiting_for_resume: this.gate.waiting,
      },
      restarts: this.restartKeys(),
    });
  }

  /** Direct `/v1/responses` calls and legacy runs marked restart, as capture keys. */
  private restartKeys(): string[] {
    const keys = new Set<string>();
    for (const call of this.gate.tickets(DIRECT)) keys.add(call.key);
    for (const key of this.steps.restarts()) {
      const s = this.sessions.get(key);
      if (s) keys.add(captureKey(s.episode));
    }
    return [...keys].sort();
  }

  /** Changes a session's state or flags, keeping the blocking set exact. */
  private update(s: Session, mutate: () => void): void {
    mutate();
    const tracked = this.sessions.get(s.key) === s;
    if (tracked && sessionBlocks(s)) this.blocking.add(s);
    else this.blocking.delete(s);
    if (tracked && s.atBoundary) this.encodeAhead.add(s);
    else this.encodeAhead.delete(s);
    // Outside a checkpoint nobody waits on readiness.
    if (!this.gate.isOpen) this.notifyChange();
  }

  // --- sessions -----------------------------------------------------------------------------

  has(key: string): boolean {
    return this.sessions.has(key);
  }

  /** Registers a session as idle (a seed's, or a legacy `/run`'s). */
  openSession(key: string, episode: EpisodeId): void {
    if (this.sessions.has(key)) return;
    const s = new Session(key, episode);
    this.sessions.set(key, s);
    this.sessionsByRollout.add(episode.rollout_id, s);
  }

  private forget(s: Session): void {
    if (this.sessions.get(s.key) !== s) return;
    this.sessions.delete(s.key);
    this.sessionsByRollout.delete(s.episode.rollout_id, s);
    this.blocking.delete(s);
    this.encodeAhead.delete(s);
    this.dropUnused(s);
    this.restoredOwners.delete(s.key);
    if (!this.gate.isOpen) this.notifyChange();
  }

  /**
   * Takes `s` out of the unused restored sessions (used, closed, freed or retired): its attempt
   * (one session per episode, as a checkpoint holds one record per episode) is no longer pending.
   */
  private dropUnused(s: Session): void {
    if (!this.unused.delete(s)) return;
    const key = captureKey(s.episode);
    for (const listener of this.restoredLeftListeners) listener(key);
  }

  /** Calls `listener` with each restored attempt's key as it stops being pending here. */
  onRestoredLeft(listener: (key: string) => void): void {
    this.restoredLeftListeners.add(listener);
  }

  /**
   * Runs a session seed: refused for a retired attempt, waits while a checkpoint is open, holds up
   * prepare while in progress (it is exported once done), and frees what it built (`free`) when
   * its attempt was retired meanwhile.
   */
  async seeding<T>(
    key: string,
    episode: EpisodeId,
    build: () => Promise<T>,
    free: () => Promise<void>,
    signal?: AbortSignal,
  ): Promise<T> {
    try {
      return await runSeed(this.gate, this.marks, {
        episode,
        signal,
        build,
        free,
        keep: () => this.openSession(key, episode),
      });
    } finally {
      if (!this.gate.isOpen) this.notifyChange();
    }
  }

  /**
   * Checks that the request's attempt owns the session (before any replay, claim or activation).
   * An unknown session is `checkpoint_error`; a retired or other attempt is `stale_attempt`.
   */
  checkAttempt(key: string, requestEpisode: EpisodeId): void {
    const s = this.sessions.get(key);
    if (!s) throw new CheckpointError(`agent session '${key}' is not open`);
    if (s.retired || this.marks.isRetired(requestEpisode)) {
      throw new StaleAttemptError(`attempt ${captureKey(requestEpisode)} was retired`);
    }
    if (!sameEpisode(s.episode, requestEpisode)) {
      throw new StaleAttemptError(
        `agent session '${key}' belongs to attempt ${captureKey(s.episode)}, not ${captureKey(requestEpisode)}`,
      );
    }
  }

  /** A replayed reply claims a restored session like an activation does. */
  claim(key: string): void {
    // The restored boundary stays for the activation that continues it.
    const s = this.sessions.get(key);
    if (s) this.used(s);
  }

  /**
   * A request used the restored session: it is no longer pending, and its record read back
   * undecoded is let go (only an unused session is written back from it).
   */
  private used(s: Session): void {
    s.restoredPending = false;
    s.raw = null;
    this.dropUnused(s);
  }

  runningActivation(key: string): { index: number | null; done: Promise<void> } | null {
    const a = this.sessions.get(key)?.activation;
    return a ? { index: a.index, done: a.done } : null;
  }

  /** Runs one activation of the session. */
  async activate<T>(
    key: string,
    requestEpisode: EpisodeId,
    index: number | null,
    work: (handle: ActivationHandle) => Promise<T>,
    signal?: AbortSignal,
  ): Promise<T> {
    this.checkAttempt(key, requestEpisode);
    const s = this.sessions.get(key)!;
    if (s.closing) throw new CheckpointError(`agent session '${key}' is closing`);
    if (s.activation)
      throw new CheckpointError(`agent session '${key}' already has an active activation`);
    const continuation = s.continuation;
    this.used(s);
    s.continuation = null;
    const activation = new Activation(index);
    // The caller going away (the environment server gave up) stops the activation too.
    const onAbort = () => activation.cancel(signal?.reason as Error);
    signal?.addEventListener('abort', onAbort, { once: true });
    if (signal?.aborted) onAbort();
    this.update(s, () => {
      s.activation = activation;
      s.state = 'running';
      s.boundary.set(null);
    });
    const handle: ActivationHandle = {
      key,
      signal: activation.controller.signal,
      continuation,
      boundary: (build) => this.boundary(s, activation, build),
      awaitingModel: (call) => this.awaitingModel(s, activation, call),
    };
    try {
      return await work(handle);
    } catch (err) {
      // Report why it was stopped (a close, a retire), not how the interrupted call failed.
      const reason: unknown = activation.controller.signal.reason;
      throw activation.controller.signal.aborted && reason instanceof Error ? reason : err;
    } finally {
      signal?.removeEventListener('abort', onAbort);
      this.update(s, () => {
        s.activation = null;
        s.state = 'idle';
        s.boundary.set(null);
      });
      activation.end();
    }
  }

  private async boundary(s: Session, a: Activation, build: () => JsonObject): Promise<void> {
    s.boundary.set(build);
    if (this.gate.isOpen) return;
    this.update(s, () => {
      s.state = 'at_boundary';
    });
    await this.parked(s, a);
  }

  /** Holds the session at its boundary until admission reopens; a retire or close stops it. */
  private async parked(s: Session, a: Activation): Promise<void> {
    try {
      await this.untilOpen(a.controller.signal);
    } finally {
      if (this.sessions.get(s.key) === s) {
        this.update(s, () => {
          s.state = 'running';
        });
      }
    }
  }

  private async awaitingModel<T>(s: Session, a: Activation, call: () => Promise<T>): Promise<T> {
    this.update(s, () => {
      s.state = 'at_boundary';
    });
    let reply: T;
    try {
      reply = await call();
    } catch (err) {
      this.update(s, () => {
        s.state = 'running';
      });
      throw err;
    }
    // A reply that arrives while a checkpoint is open is held: the session stays at the boundary
    // before the call, so its readiness never regresses between prepare and commit.
    await this.parked(s, a);
    return reply;
  }

  /**
   * Closes a session: waits while admission is closed, marks it closing, stops its activation
   * (cancelling only one nothing cancelled yet) and waits for it, then runs `cleanup` exactly once.
   * A close a retire took over is `stale_attempt`; one cancelled while it waits ran no cleanup.
   */
  async closeSession<T>(key: string, cleanup: () => Promise<T>, signal?: AbortSignal): Promise<T> {
    await this.gate.pass({ signal, rule: agentCloseAdmission });
    const s = this.sessions.get(key);
    if (!s) return cleanup();
    const current = () => this.sessions.get(key) === s && !s.retired;
    if (!current()) throw new StaleAttemptError(`agent session '${key}' was retired`);
    this.update(s, () => {
      s.closing = true;
    });
    try {
      const activation = s.activation;
      if (activation) {
        activation.cancel(new CheckpointError(`agent session '${key}' is closing`));
        await untilSettledOr(activation.done, signal);
      }
      if (!current()) throw new StaleAttemptError(`agent session '${key}' was retired`);
      const result = await cleanup();
      if (!current()) throw new StaleAttemptError(`agent session '${key}' was retired`);
      this.forget(s);
      return result;
    } finally {
      if (this.sessions.get(key) === s) {
        this.update(s, () => {
          s.closing = false;
        });
      }
    }
  }

  // --- direct calls -------------------------------------------------------------------------

  /** A direct `/v1/responses` call under a rollout path: a restart, never blocking, retired like work. */
  directRestart<T>(episode: EpisodeId, work: (signal: AbortSignal) => Promise<T>): Promise<T> {
    return this.gate.run(restartCall(episode, DIRECT, this.marks), (call) => work(call.signal));
  }

  // --- legacy /run ----------------------------------------------------------------------------

  /**
   * Runs a legacy `/run` episode under `run:<rollout_id>`: a session (so its self-dispatch is an
   * activation) plus protocol steps continuing from a restored boundary.
   */
  async legacyRun<T>(episode: EpisodeId, work: (ep: EpisodeContext) => Promise<T>): Promise<T> {
    const key = legacyKey(episode.rollout_id);
    if (this.claims?.holds(captureKey(episode))) await this.claimLegacy(episode, key);
    const existing = this.sessions.get(key);
    const retired = this.marks.isRetired(episode);
    const refusal = legacyRunAdmission({ open: this.gate.isOpen, episode, retired, key, existing });
    if (refusal) throw refusal;
    let continuation: Boundary | null = null;
    if (existing) {
      continuation = this.legacyRestored.get(key) ?? null;
      this.legacyRestored.delete(key);
      this.claim(key);
    } else {
      this.openSession(key, episode);
    }
    const s = this.sessions.get(key)!;
    s.legacy = true;
    try {
      return await this.steps.run(key, { continuation }, work);
    } finally {
      if (!s.retired) this.forget(s);
    }
  }

  /**
   * A replacement `/run` whose restored record its worker's coordinator holds: refused as any
   * `/run` is for a retired or running attempt before it claims (a refused request claims
   * nothing), then it claims the record and installs it here. Another worker's claim won: the
   * attempt runs there, and this one is refused as a second `/run` of a running attempt is.
   */
  private async claimLegacy(episode: EpisodeId, key: string): Promise<void> {
    const existing = this.sessions.get(key);
    const retired = this.marks.isRetired(episode);
    const refusal = legacyRunAdmission({ open: true, episode, retired, key, existing });
    if (refusal) throw refusal;
    const record = await this.claims!.claim(captureKey(episode));
    if (record === null) {
      throw new CheckpointError(
        `legacy run ${key} is already running: another worker claimed its restored record`,
      );
    }
    await this.installRecords([record]);
  }

  // --- export and install ---------------------------------------------------------------------

  async export(
    scope: readonly EpisodeId[] | null,
    signal: AbortSignal,
  ): Promise<AgentSessionRecord[]> {
    const inScope = scope === null ? null : this.sessionsOf(scope);
    const legacy = this.steps.exported();
    const chosen: Session[] = [];
    for (const s of this.sessions.values()) {
      if (s.retired || s.closing || this.isCarried(s.episode)) continue;
      if (inScope !== null && !inScope.has(s)) continue;
      if (s.legacy && !legacy.has(s.key) && !s.restoredPending) continue;
      chosen.push(s);
    }
    if (chosen.length === 0) return [];
    // An unclaimed restored session is unchanged: its checkpointed text is written back as it is.
    const asked = chosen.filter((s) => this.untouchedRaw(s) === null).map((s) => s.key);
    const exported =
      asked.length > 0 ? await this.hooks.exportAgentSessions(asked) : new Map<string, JsonValue>();
    signal.throwIfAborted();
    const states = chosen.map((s) => this.untouchedRaw(s) ?? exported.get(s.key));
    const missing = chosen.filter((_, i) => states[i] === undefined);
    if (missing.length > 0) {
      throw new CheckpointError(
        `the agent did not export sessions [${missing
          .slice(0, 10)
          .map((s) => s.key)
          .join(', ')}]`,
      );
    }
    return chosen.map((s, i) => this.exportedRecord(s, states[i]!, legacy));
  }

  /** The restored record of an unclaimed session, whose state nothing changed; else null. */
  private untouchedRaw(s: Session): RawRecord | null {
    return s.restoredPending ? s.raw : null;
  }

  private exportedRecord(
    s: Session,
    state: JsonValue | RawRecord,
    legacy: ReadonlyMap<string, Boundary | null>,
  ): AgentSessionRecord {
    const raw = state === s.raw ? s.raw : null;
    const owner = s.legacy ? undefined : this.ownerOf(s.key);
    const record: AgentSessionRecord = {
      episode_id: s.episode,
      session_key: s.key,
      ...(owner === undefined ? {} : { owner }),
      boundary: s.exportedBoundary(),
      episode: s.legacy
        ? (legacy.get(s.key) ??
          (s.restoredPending ? (this.legacyRestored.get(s.key) ?? null) : null))
        : null,
      session: raw === null ? (state as JsonValue) : null,
    };
    if (raw !== null) {
      // Decoded only if the store must encode the record itself (the pieces failed).
      Object.defineProperty(record, 'session', { get: () => raw.field('session') ?? null });
    }
    const pieces =
      raw === null && !s.legacy
        ? this.encodedFields(s, record.session)
        : recordPieces(
            record,
            () => (raw === null ? this.sessionJson(record.session) : [raw.fieldBytes('session')!]),
            () => s.exportedBoundaryJson(),
          );
    if (pieces !== undefined) record[RECORD_FIELDS_JSON] = pieces;
    return record;
  }

  /**
   * The fields of a (non-legacy) session's record as UTF-8, kept on the session while its state is
   * the same object and its boundary the same JSON: encoded ahead in an idle turn, a commit only
   * copies them. A new state or boundary is encoded again. None when something is not JSON.
   */
  private encodedFields(s: Session, state: JsonValue): readonly Uint8Array[] | undefined {
    let boundary: string;
    try {
      boundary = s.exportedBoundaryJson();
    } catch {
      return undefined;
    }
    const kept = s.encoded;
    if (kept !== null && kept.state === state && kept.boundary === boundary) return kept.pieces;
    const owner = this.ownerOf(s.key);
    const record = { session_key: s.key, episode: null, ...(owner === undefined ? {} : { owner }) };
    const pieces = recordPieces(
      record,
      () => this.sessionJson(state),
      () => boundary,
    );
    if (pieces === undefined) return undefined;
    if (typeof state !== 'object' || state === null) return textsAsBytes(pieces);
    s.encoded = { state, boundary, pieces: textsAsBytes(pieces) };
    return s.encoded.pieces;
  }

  private sessionJson(state: JsonValue): readonly (string | Uint8Array)[] {
    if (typeof state !== 'object' || state === null) return [encodeJson(state)];
    let pieces = this.sessionPieces.get(state);
    if (pieces === undefined) {
      pieces = encodeJsonBytes(state);
      this.sessionPieces.set(state, pieces);
    }
    return pieces;
  }

  /**
   * The sessions of the scope's attempts, through the rollout index: a scope of thousands builds
   * no capture-key string per entry.
   */
  private sessionsOf(scope: readonly EpisodeId[]): Set<Session> {
    const sessions = new Set<Session>();
    for (const e of scope) {
      for (const s of this.sessionsByRollout.view(e.rollout_id)) {
        if (s.episode.attempt === e.attempt) sessions.add(s);
      }
    }
    return sessions;
  }

  /**
   * The owner a native session's cookie names: the one its record named when a restore installed
   * it here, else this worker (none in one process).
   */
  private ownerOf(key: string): string | undefined {
    return this.restoredOwners.has(key) ? this.restoredOwners.get(key) : this.owner;
  }

  validateRecord(record: JsonObject, key: string): AgentSessionRecord {
    return agentRecordOf(record, key);
  }

  /**
   * A small record is decoded now (one native parse costs less than scanning its fields in JS). A
   * larger one written as this participant writes it is read from the fields ahead of its state,
   * the state decoded when first used (`recordOfHead`); one in another order as
   * `agentRecordOfRaw` reads it.
   */
  validateRawRecord(record: RawRecord, key: string): AgentSessionRecord {
    if (record.bytes.length < DEFER_DECODE_MIN_BYTES)
      return this.validateRecord(record.decode(), key);
    return recordOfHead(record, key) ?? agentRecordOfRaw(record, key);
  }

  override checkRestore(): void {
    if (this.gate.count(SEED) > 0) {
      throw new CheckpointError('a restore is refused while an agent session seed is in progress');
    }
  }

  async install(records: AgentSessionRecord[], _scope: readonly EpisodeId[]): Promise<void> {
    this.checkRestore();
    if (this.sessions.size > 0 || this.steps.size > 0) {
      throw new CheckpointError('a restore needs an agent server without live sessions');
    }
    await this.installRecords(records);
  }

  /** Installs restored sessions (a restore's, or a legacy record this worker claimed). */
  private async installRecords(records: readonly AgentSessionRecord[]): Promise<void> {
    const restored: RestoredAgentSession[] = records.map((r) => ({
      sessionKey: r.session_key,
      episode: nextAttempt(r.episode_id),
      // Read through the record: one read back undecoded decodes its state only now.
      get session(): JsonValue {
        return r.session;
      },
    }));
    await this.hooks.restoreAgentSessions(restored);
    for (const [i, r] of records.entries()) {
      const s = new Session(r.session_key, restored[i]!.episode);
      s.restoredPending = true;
      this.unused.add(s);
      s.raw = r[RAW_RECORD] ?? null;
      s.continuation = r.boundary;
      if (isLegacyRecord(r)) {
        s.legacy = true;
        this.legacyRestored.set(r.session_key, r.episode);
      } else {
        this.restoredOwners.set(r.session_key, r.owner);
      }
      this.sessions.set(s.key, s);
      this.sessionsByRollout.add(s.episode.rollout_id, s);
    }
  }

  restoredPending(): EpisodeId[] {
    return [...this.unused].map((s) => s.episode);
  }

  /** The native sessions held here, each marked when it is a restored copy no request used yet. */
  sessionCopies(): { id: string; unused: boolean }[] {
    const copies: { id: string; unused: boolean }[] = [];
    for (const s of this.sessions.values()) {
      if (!s.legacy) copies.push({ id: s.key, unused: this.unused.has(s) });
    }
    return copies;
  }

  /**
   * Frees restored copies no request used, because another worker's copy of the session is live
   * (it was seeded again there); a copy used meanwhile is kept.
   */
  async freeUnused(sessionIds: readonly string[]): Promise<void> {
    for (const id of sessionIds) {
      const s = this.sessions.get(id);
      if (!s || !this.unused.has(s)) continue;
      await this.hooks.retireAgentSession(s.key);
      this.forget(s);
    }
  }

  // --- retire -------------------------------------------------------------------------------

  /**
   * Stops the attempt and its earlier ones: waits for their seeds, then per session marks it
   * retired (it blocks and is not exported), cancels its activation once and waits for it, retires
   * the legacy episode, runs the retire hook, and only then forgets it. A retire cut short leaves
   * the session for a retry, which waits again without cancelling twice.
   */
  async retire(episode: EpisodeId): Promise<void> {
    await this.gate.drain(episode, SEED);
    await Promise.all([
      this.gate.retire(episode, DIRECT),
      ...this.sessionsByRollout
        .of(episode.rollout_id)
        .filter((s) => covers(episode, s.episode))
        .map((s) => this.retireSession(s)),
    ]);
  }

  private retireSession(s: Session): Promise<void> {
    s.retiring ??= (async () => {
      this.update(s, () => {
        s.retired = true;
      });
      this.dropUnused(s);
      s.activation?.cancel(new StaleAttemptError(`attempt ${captureKey(s.episode)} was retired`));
      await s.activation?.done;
      if (s.legacy) await this.steps.retire(s.key);
      await this.hooks.retireAgentSession(s.key);
      this.legacyRestored.delete(s.key);
      this.forget(s);
    })().catch((err: unknown) => {
      s.retiring = null;
      throw err;
    });
    return s.retiring;
  }

  override checkForget(rolloutIds: readonly string[]): void {
    const holding = rolloutIds.filter((r) => this.sessionsByRollout.of(r).some((s) => s.retired));
    if (holding.length > 0) {
      throw new RetireIncompleteError(
        `retired agent sessions still held for rollouts ${holding.join(', ')}`,
      );
    }
  }

  override statusExtra(): Record<string, unknown> {
    return { accepting: this.gate.isOpen };
  }

  /** The attempt that owns `key`, if tracked. */
  episodeOf(key: string): EpisodeId | undefined {
    return this.sessions.get(key)?.episode;
  }
}
