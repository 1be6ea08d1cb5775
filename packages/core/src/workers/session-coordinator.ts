/**
 * A server kind whose state spans requests in sessions (resources, a native agent) with several
 * workers (`num_workers: N`) under checkpointing: one participant, a `ParticipantCoordinator`,
 * with each worker running the kind's one-process participant for the sessions it owns, and its
 * `SessionRouter` sending every request of a session to the worker that owns it. What sessions
 * add (docs/workers.md, "Sessions across workers"):
 *
 * - every worker registers its routing id; the manifest lists every owner a cookie may name at
 *   commit (the live workers, and the owners the exported records name), so a restore aliases
 *   them all, sessions or not;
 * - a restore places every record of one pre-crash owner on one live worker, owners by load,
 *   sessions that name no owner one by one (`placeSessions`), and hands every worker's router the
 *   alias and placement tables before any worker installs (and a worker that joins later with its
 *   join state, every worker again on reopening); records a request claims (an agent's legacy
 *   `/run`) stay held in the coordinator as `ParticipantCoordinator` holds them;
 * - a commit exports one copy per session: a restored copy no request used, of a session seeded
 *   again on another worker, is freed and left out (`oneCopyPerSession`).
 */
import { CheckpointError } from '../errors.js';
import { captureKey, type EpisodeId } from '../identity.js';
import type { JsonObject, JsonValue } from '../json.js';
import type { Logger } from '../logging.js';
import type { Participant } from '../participant.js';
import type { CheckpointRecord, Manifest } from '../store.js';
import type { WorkerMessage } from './coordinator.js';
import { type CoordinatedRecords, ParticipantCoordinator } from './participant-coordinator.js';
import { type CoordinatorCalls, ParticipantWorker } from './participant-worker.js';
import type { SessionRef } from './session-owners.js';
import { oneCopyPerSession, type Placement, placeSessions } from './session-placement.js';
import { type RoutingState, SessionRouter } from './session-router.js';
import type { WorkerInfo } from './types.js';

/** The kind messages a session coordinator adds. */
export const SESSION_MESSAGES = {
  /** Coordinator → worker: adopt these routing tables now (a restore, before installing). */
  routing: 'session_routing',
  /** Coordinator → worker: the sessions you hold, each marked when an unused restored copy. */
  copies: 'session_copies',
  /** Coordinator → worker: free these unused restored copies (another copy is live). */
  freeUnused: 'free_unused_sessions',
  /** Worker → coordinator: these restored attempts were used here (no longer pending). */
  used: 'restored_used',
} as const;

const ROUTING_ID_KEY = 'routing_id';
const SESSION_OWNERS_KEY = 'session_owners';

function routingIdOf(worker: WorkerInfo): string {
  const id = worker.registration.extra[ROUTING_ID_KEY];
  if (typeof id !== 'string') {
    throw new CheckpointError(`worker ${worker.index} registered no routing id`);
  }
  return id;
}

/** The owners a manifest lists (an older manifest, or one process's, lists none). */
export function manifestOwners(manifest: Manifest): string[] {
  const owners = manifest[SESSION_OWNERS_KEY];
  return Array.isArray(owners) ? owners.filter((o): o is string => typeof o === 'string') : [];
}

/** A kind's session records: checked and claimed as `CoordinatedRecords`, and named by session. */
export interface SessionRecords<R extends CheckpointRecord> extends CoordinatedRecords<R> {
  /** The session a record no request claims holds, and the owner its cookie names (if any). */
  sessionOf(record: R): SessionRef;
  /** Every field `claimedByRequest` and `sessionOf` read: a commit reads them of every record. */
  readonly exportedFields: readonly string[];
}

export interface SessionCoordinatorOptions<R extends CheckpointRecord> {
  readonly kind: 'resources' | 'agent';
  readonly instance: string;
  readonly expectedWorkers: number;
  readonly logger?: Logger | undefined;
  readonly records: SessionRecords<R>;
}

export class SessionCoordinator<
  R extends CheckpointRecord = CheckpointRecord,
> extends ParticipantCoordinator<R> {
  readonly #records: SessionRecords<R>;
  /** Pre-crash owner → the routing id of the worker that holds its sessions; grows per restore. */
  readonly #aliases = new Map<string, string>();
  /** Session that names no owner → the routing id of the worker the last restore placed it on. */
  #placements = new Map<string, string>();
  /** The owners the checkpoint being restored lists. */
  #restoringOwners: string[] = [];
  /** The owners the last export's records name. */
  #exportedOwners = new Set<string>();
  #placement: Placement | undefined;
  /**
   * Restored attempts a worker reported used since the last restore: the workers' pending lists
   * the coordinator keeps are as of the last install or export, and an attempt once used is
   * never pending again.
   */
  readonly #used = new Set<string>();

  constructor(options: SessionCoordinatorOptions<R>) {
    super(options);
    this.#records = options.records;
  }

  #routingState(): JsonObject {
    return SessionRouter.state(this.#aliases, this.#placements);
  }

  override handle(worker: WorkerInfo, kind: string, body: JsonValue): Promise<unknown> {
    if (kind !== SESSION_MESSAGES.used) return super.handle(worker, kind, body);
    for (const key of (body as { keys: string[] }).keys) this.#used.add(key);
    return Promise.resolve({});
  }

  override restoredPending(): EpisodeId[] {
    return super.restoredPending().filter((e) => !this.#used.has(captureKey(e)));
  }

  override joinState(worker: WorkerInfo): JsonObject {
    return { ...super.joinState(worker), ...this.#routingState() };
  }

  override openState(): JsonObject {
    return { ...super.openState(), ...this.#routingState() };
  }

  // --- commit -----------------------------------------------------------------------------------

  override async export(scope: readonly EpisodeId[] | null): Promise<R[]> {
    await this.#oneCopyPerSession();
    const records = await super.export(scope);
    this.#exportedOwners = new Set(
      records.flatMap((r) => {
        const owner = this.#claimedHere(r) ? undefined : this.#records.sessionOf(r).owner;
        return owner === undefined ? [] : [owner];
      }),
    );
    return records;
  }

  /** Frees the unused restored copies of sessions another worker holds live. */
  async #oneCopyPerSession(): Promise<void> {
    const replies = await this.broadcast(SESSION_MESSAGES.copies, {});
    const copies = [...replies].flatMap(([worker, reply]) =>
      (reply as unknown as { id: string; unused: boolean }[]).map((c) => ({
        worker,
        sessionId: c.id,
        unused: c.unused,
      })),
    );
    const { stale, conflicts } = oneCopyPerSession(copies);
    for (const sessionId of conflicts) {
      this.logger.error(
        `a ${this.label} session is live on several workers; one copy is exported`,
        {
          session_id: sessionId,
        },
      );
    }
    const byWorker = new Map<number, string[]>();
    for (const copy of stale) {
      const ids = byWorker.get(copy.worker);
      if (ids === undefined) byWorker.set(copy.worker, [copy.sessionId]);
      else ids.push(copy.sessionId);
    }
    if (byWorker.size === 0) return;
    const messages = new Map<number, WorkerMessage>(
      [...byWorker].map(([worker, ids]) => [
        worker,
        { kind: SESSION_MESSAGES.freeUnused, body: { session_ids: ids } },
      ]),
    );
    await this.callEach(messages);
  }

  /** Every owner a cookie may name now: the live workers, and those the exported records name. */
  override manifestExtra(): Record<string, unknown> {
    const owners = new Set(this.#exportedOwners);
    for (const worker of this.workers()) owners.add(routingIdOf(worker));
    return { [SESSION_OWNERS_KEY]: [...owners].sort() };
  }

  // --- restore ----------------------------------------------------------------------------------

  restoreManifest(manifest: Manifest): void {
    this.#restoringOwners = manifestOwners(manifest);
  }

  /** Places the records, hands every router the tables, then installs (`place` below). */
  override async install(records: R[], scope: readonly EpisodeId[]): Promise<void> {
    this.checkRestore();
    this.#used.clear();
    const workers = this.workers().map((w) => ({ index: w.index, routingId: routingIdOf(w) }));
    const sessions = records
      .filter((r) => !this.#claimedHere(r))
      .map((r) => this.#records.sessionOf(r));
    const placement = placeSessions({ sessions, owners: this.#restoringOwners }, workers);
    for (const [owner, to] of placement.aliases) this.#aliases.set(owner, to);
    this.#placements = new Map(placement.placements);
    // Before any worker holds a restored session, every router sends its requests there.
    await this.broadcast(SESSION_MESSAGES.routing, this.#routingState());
    this.#placement = placement;
    try {
      await super.install(records, scope);
    } finally {
      this.#placement = undefined;
    }
  }

  /** A record whose state lives inside one request: held here for a claim, never placed. */
  #claimedHere(record: R): boolean {
    return this.#records.claimedByRequest(record);
  }

  protected override place(records: readonly R[]): Map<number, R[]> {
    const workerOf = new Map<string, number>();
    for (const [index, ids] of this.#placement?.sessions ?? []) {
      for (const id of ids) workerOf.set(id, index);
    }
    const placed = new Map<number, R[]>();
    for (const record of records) {
      const index = workerOf.get(this.#records.sessionOf(record).id);
      if (index === undefined) return super.place(records);
      const onWorker = placed.get(index);
      if (onWorker === undefined) placed.set(index, [record]);
      else onWorker.push(record);
    }
    return placed;
  }

  override statusExtra(): Record<string, unknown> {
    return {
      ...super.statusExtra(),
      session_aliases: this.#aliases.size,
      session_placements: this.#placements.size,
    };
  }
}

/** What a session worker needs of its kind's one-process participant beyond `Participant`. */
export interface SessionParticipant<R extends CheckpointRecord> extends Participant<R> {
  /**
   * Calls `listener` with each restored attempt's capture key as it stops being pending here (a
   * request used it, or its last unused session was closed, freed or retired).
   */
  onRestoredLeft(listener: (key: string) => void): void;
  /** The sessions held here, each marked when it is a restored copy no request used yet. */
  sessionCopies(): { id: string; unused: boolean }[];
  /** Frees restored copies no request used (another worker's copy is live); a used one stays. */
  freeUnused(sessionIds: readonly string[]): Promise<void>;
}

/** One worker of a session kind with several workers: its participant and its router. */
export class SessionWorker<
  R extends CheckpointRecord = CheckpointRecord,
> extends ParticipantWorker<R> {
  readonly #participant: SessionParticipant<R>;
  readonly #router: SessionRouter;
  readonly #link: CoordinatorCalls;
  readonly #logger: Logger;
  /** Restored attempts no longer pending here, not yet told to the coordinator. */
  #left: string[] = [];

  constructor(
    participant: SessionParticipant<R>,
    router: SessionRouter,
    link: CoordinatorCalls,
    logger: Logger,
  ) {
    super(participant, link, logger);
    this.#participant = participant;
    this.#router = router;
    this.#link = link;
    this.#logger = logger;
    participant.onRestoredLeft((key) => this.#restoredLeft(key));
  }

  /** Collects the attempts that stopped being pending in this turn: one message tells them all. */
  #restoredLeft(key: string): void {
    this.#left.push(key);
    if (this.#left.length === 1) setImmediate(() => this.#reportLeft());
  }

  #reportLeft(): void {
    const keys = this.#left;
    this.#left = [];
    this.#link.call(SESSION_MESSAGES.used, { keys }).catch((err: unknown) =>
      this.#logger.warn('could not tell the coordinator of restored sessions used', {
        error: String(err),
      }),
    );
  }

  registration(): JsonObject {
    return { [ROUTING_ID_KEY]: this.#router.routingId };
  }

  override adopt(state: JsonObject): void {
    super.adopt(state);
    this.#router.adopt(state as unknown as RoutingState);
  }

  override async handle(kind: string, body: JsonValue, bytes?: Uint8Array): Promise<unknown> {
    switch (kind) {
      case SESSION_MESSAGES.routing:
        this.#router.adopt(body as unknown as RoutingState);
        return {};
      case SESSION_MESSAGES.copies:
        return this.#participant.sessionCopies();
      case SESSION_MESSAGES.freeUnused:
        await this.#participant.freeUnused((body as { session_ids: string[] }).session_ids);
        return {};
      default:
        return super.handle(kind, body, bytes);
    }
  }
}
