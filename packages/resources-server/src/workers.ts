/**
 * A resources server with several workers (`num_workers: N`) under checkpointing: one
 * participant, core's `ParticipantCoordinator`, with each worker running the one-process
 * resources participant for the sessions it owns. What resources add (docs/workers.md):
 *
 * - every worker registers its routing id; the manifest lists every owner a cookie may name at
 *   commit (the live workers, and the owners the exported records name), so a restore aliases
 *   them all, sessions or not;
 * - a restore places every record of one pre-crash owner on one live worker, owners by load,
 *   sessions that name no owner one by one (`placeSessions`), and hands every worker's router the
 *   alias and placement tables before any worker installs (and a worker that joins later with its
 *   join state, every worker again on reopening);
 * - a commit exports one copy per session: a restored copy no request used, of a session seeded
 *   again on another worker, is freed and left out (`oneCopyPerSession`).
 */
import {
  captureKey,
  CheckpointError,
  type EpisodeId,
  type JsonObject,
  type JsonValue,
} from '@ckpt-gym/core/protocol';
import {
  type CoordinatorCalls,
  type Logger,
  type Manifest,
  oneCopyPerSession,
  PARTICIPANT_MESSAGES,
  ParticipantCoordinator,
  ParticipantWorker,
  type Placement,
  placeSessions,
  type RoutingState,
  SessionRouter,
  type WorkerInfo,
  type WorkerMessage,
} from '@ckpt-gym/core/server';

import type { ResourcesParticipant, ResourcesSessionRecord } from './participant.js';

/** The kind messages the resources coordinator adds. */
export const RESOURCES_MESSAGES = {
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
    throw new CheckpointError(`resources worker ${worker.index} registered no routing id`);
  }
  return id;
}

/** The owners a manifest lists (an older manifest, or one process's, lists none). */
export function manifestOwners(manifest: Manifest): string[] {
  const owners = manifest[SESSION_OWNERS_KEY];
  return Array.isArray(owners) ? owners.filter((o): o is string => typeof o === 'string') : [];
}

export interface ResourcesCoordinatorOptions {
  readonly instance: string;
  readonly expectedWorkers: number;
  readonly logger?: Logger;
  /** Checks records as the one-process participant does (only its record checks are used). */
  readonly records: Pick<ResourcesParticipant, 'validateRecord'>;
}

export class ResourcesCoordinator extends ParticipantCoordinator<ResourcesSessionRecord> {
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

  constructor(options: ResourcesCoordinatorOptions) {
    super({
      kind: 'resources',
      instance: options.instance,
      expectedWorkers: options.expectedWorkers,
      logger: options.logger,
      records: {
        validateRecord: (record, key) => options.records.validateRecord(record, key),
        // A session's state spans requests: it is placed on a worker, never claimed.
        claimedByRequest: () => false,
      },
    });
  }

  #routingState(): JsonObject {
    return SessionRouter.state(this.#aliases, this.#placements);
  }

  override handle(worker: WorkerInfo, kind: string, body: JsonValue): Promise<unknown> {
    if (kind !== RESOURCES_MESSAGES.used) return super.handle(worker, kind, body);
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

  override async export(scope: readonly EpisodeId[] | null): Promise<ResourcesSessionRecord[]> {
    await this.#oneCopyPerSession();
    const records = await super.export(scope);
    this.#exportedOwners = new Set(records.flatMap((r) => (r.owner ? [r.owner] : [])));
    return records;
  }

  /** Frees the unused restored copies of sessions another worker holds live. */
  async #oneCopyPerSession(): Promise<void> {
    const replies = await this.broadcast(RESOURCES_MESSAGES.copies, {});
    const copies = [...replies].flatMap(([worker, reply]) =>
      (reply as unknown as { id: string; unused: boolean }[]).map((c) => ({
        worker,
        sessionId: c.id,
        unused: c.unused,
      })),
    );
    const { stale, conflicts } = oneCopyPerSession(copies);
    for (const sessionId of conflicts) {
      this.logger.error('a resources session is live on several workers; one copy is exported', {
        session_id: sessionId,
      });
    }
    const byWorker = new Map<number, string[]>();
    for (const copy of stale)
      byWorker.set(copy.worker, [...(byWorker.get(copy.worker) ?? []), copy.sessionId]);
    if (byWorker.size === 0) return;
    const messages = new Map<number, WorkerMessage>(
      [...byWorker].map(([worker, ids]) => [
        worker,
        { kind: RESOURCES_MESSAGES.freeUnused, body: { session_ids: ids } },
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
  override async install(
    records: ResourcesSessionRecord[],
    scope: readonly EpisodeId[],
  ): Promise<void> {
    this.checkRestore();
    this.#used.clear();
    const workers = this.workers().map((w) => ({ index: w.index, routingId: routingIdOf(w) }));
    const sessions = records.map((r) => ({ id: r.session_id, owner: r.owner }));
    const placement = placeSessions({ sessions, owners: this.#restoringOwners }, workers);
    for (const [owner, to] of placement.aliases) this.#aliases.set(owner, to);
    this.#placements = new Map(placement.placements);
    // Before any worker holds a restored session, every router sends its requests there.
    await this.broadcast(RESOURCES_MESSAGES.routing, this.#routingState());
    this.#placement = placement;
    try {
      await super.install(records, scope);
    } finally {
      this.#placement = undefined;
    }
  }

  protected override place(
    records: readonly ResourcesSessionRecord[],
  ): Map<number, ResourcesSessionRecord[]> {
    const workerOf = new Map<string, number>();
    for (const [index, ids] of this.#placement?.sessions ?? []) {
      for (const id of ids) workerOf.set(id, index);
    }
    const placed = new Map<number, ResourcesSessionRecord[]>();
    for (const record of records) {
      const index = workerOf.get(record.session_id);
      if (index === undefined) return super.place(records);
      placed.set(index, [...(placed.get(index) ?? []), record]);
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

/** One worker of a resources server with several workers: its participant and its router. */
export class ResourcesWorker extends ParticipantWorker<ResourcesSessionRecord> {
  readonly #participant: ResourcesParticipant;
  readonly #router: SessionRouter;
  readonly #link: CoordinatorCalls;
  readonly #logger: Logger;
  /** The restored attempts pending here, as of the last install or report of their use. */
  #pending = new Set<string>();

  constructor(
    participant: ResourcesParticipant,
    router: SessionRouter,
    link: CoordinatorCalls,
    logger: Logger,
  ) {
    super(participant, link, logger);
    this.#participant = participant;
    this.#router = router;
    this.#link = link;
    this.#logger = logger;
    participant.onChange(() => this.#reportUsed());
  }

  #pendingKeys(): Set<string> {
    return new Set(this.#participant.restoredPending().map(captureKey));
  }

  /** Tells the coordinator which restored attempts a request used here since the last time. */
  #reportUsed(): void {
    if (this.#participant.restoredPendingCount === this.#pending.size) return;
    const now = this.#pendingKeys();
    const keys = [...this.#pending].filter((key) => !now.has(key));
    this.#pending = now;
    if (keys.length === 0) return;
    this.#link.call(RESOURCES_MESSAGES.used, { keys }).catch((err: unknown) =>
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

  override async handle(kind: string, body: JsonValue): Promise<unknown> {
    switch (kind) {
      case RESOURCES_MESSAGES.routing:
        this.#router.adopt(body as unknown as RoutingState);
        return {};
      case RESOURCES_MESSAGES.copies:
        return this.#participant.sessionCopies();
      case RESOURCES_MESSAGES.freeUnused:
        await this.#participant.freeUnused((body as { session_ids: string[] }).session_ids);
        return {};
      case PARTICIPANT_MESSAGES.install: {
        const reply = await super.handle(kind, body);
        this.#pending = this.#pendingKeys();
        return reply;
      }
      default:
        return super.handle(kind, body);
    }
  }
}
