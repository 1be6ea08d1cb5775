/**
 * Where a restore puts sessions, as a pure rule. Every record of one pre-crash owner goes to one
 * live worker (its cookies name that owner, so one alias routes them all); a session that names no
 * owner (checkpointed by a single-process server) is placed on its own. Groups go, largest first,
 * to the live worker with the least load so far: records, then groups, ties by index.
 */
import type { SessionRef } from './session-owners.js';

/** A live worker as placement sees it. */
export interface PlacementWorker {
  readonly index: number;
  readonly routingId: string;
}

/** What a restore places: its sessions, and every owner a cookie may name (none exported too). */
export interface PlacementInput {
  readonly sessions: readonly SessionRef[];
  readonly owners: readonly string[];
}

export interface Placement {
  /** Worker index → the session ids it installs. */
  readonly sessions: ReadonlyMap<number, readonly string[]>;
  /** Pre-crash owner → the routing id of the worker that holds its sessions now. */
  readonly aliases: ReadonlyMap<string, string>;
  /** Session that names no owner → the routing id of the worker that holds it. */
  readonly placements: ReadonlyMap<string, string>;
}

interface Group {
  /** `owner:<routing id>` or `session:<id>`: unique, and the tie-break order. */
  readonly key: string;
  readonly owner: string | undefined;
  readonly sessionIds: string[];
}

function groupsOf(input: PlacementInput): Group[] {
  const groups = new Map<string, Group>();
  const groupFor = (key: string, owner: string | undefined): Group => {
    let group = groups.get(key);
    if (!group) {
      group = { key, owner, sessionIds: [] };
      groups.set(key, group);
    }
    return group;
  };
  for (const owner of input.owners) groupFor(`owner:${owner}`, owner);
  for (const { id, owner } of input.sessions) {
    const group =
      owner === undefined
        ? groupFor(`session:${id}`, undefined)
        : groupFor(`owner:${owner}`, owner);
    group.sessionIds.push(id);
  }
  return [...groups.values()];
}

export function placeSessions(
  input: PlacementInput,
  workers: readonly PlacementWorker[],
): Placement {
  const live = [...workers].sort((a, b) => a.index - b.index);
  const sessions = new Map<number, string[]>(live.map((w) => [w.index, []]));
  const aliases = new Map<string, string>();
  const placements = new Map<string, string>();
  if (live.length === 0) return { sessions, aliases, placements };
  const load = new Map(live.map((w) => [w.index, { records: 0, groups: 0 }]));
  const groups = groupsOf(input).sort(
    (a, b) => b.sessionIds.length - a.sessionIds.length || (a.key < b.key ? -1 : 1),
  );
  for (const group of groups) {
    const worker = leastLoaded(live, load);
    const held = load.get(worker.index)!;
    held.records += group.sessionIds.length;
    held.groups += 1;
    sessions.get(worker.index)!.push(...group.sessionIds);
    if (group.owner !== undefined) aliases.set(group.owner, worker.routingId);
    else placements.set(group.sessionIds[0]!, worker.routingId);
  }
  return { sessions, aliases, placements };
}

function leastLoaded(
  live: readonly PlacementWorker[],
  load: ReadonlyMap<number, { records: number; groups: number }>,
): PlacementWorker {
  let best = live[0]!;
  for (const worker of live) {
    const a = load.get(worker.index)!;
    const b = load.get(best.index)!;
    if (a.records < b.records || (a.records === b.records && a.groups < b.groups)) best = worker;
  }
  return best;
}

/** One worker's exported copy of a session. */
export interface SessionCopy {
  readonly worker: number;
  readonly sessionId: string;
  /** Installed by a restore and used by no request since. */
  readonly unused: boolean;
}

export interface OneCopy<C extends SessionCopy> {
  /** The copy each session exports. */
  readonly kept: C[];
  /** Unused restored copies of a session another copy won: their worker frees them. */
  readonly stale: C[];
  /** Sessions live on several workers (a routing fault): one copy is kept, the others logged. */
  readonly conflicts: string[];
}

/**
 * One copy per session at export. A restored session can be seeded again on another worker (a
 * request that reached it before the routing tables did); that copy is live, and the restored
 * copy no request used is stale: left out, and freed. Two live copies keep the first.
 */
export function oneCopyPerSession<C extends SessionCopy>(copies: readonly C[]): OneCopy<C> {
  const bySession = new Map<string, C[]>();
  for (const copy of copies) {
    const found = bySession.get(copy.sessionId);
    if (found) found.push(copy);
    else bySession.set(copy.sessionId, [copy]);
  }
  const kept: C[] = [];
  const stale: C[] = [];
  const conflicts: string[] = [];
  for (const [sessionId, found] of bySession) {
    const live = found.filter((c) => !c.unused);
    const winner = live[0] ?? found[0]!;
    kept.push(winner);
    for (const copy of found) if (copy !== winner && copy.unused) stale.push(copy);
    if (live.length > 1) conflicts.push(sessionId);
  }
  return { kept, stale, conflicts };
}
