/**
 * Who owns a session, as small pure rules. A server with several workers keeps each session in
 * the memory of the worker that seeded it; every worker has a random routing id, and a session it
 * creates is named `<routing id>.<local id>`, so whatever the client keeps (a signed cookie, an MCP
 * token) names the owner without a new format. A restore moves each pre-crash owner's sessions to
 * one live worker (the alias table) and places sessions that name no owner (checkpointed by a
 * single-process server) one by one (the placement table, by session id). docs/workers.md.
 */
import { randomBytes } from 'node:crypto';

/** 16 lowercase hex digits: 64 random bits per worker process. */
const ROUTING_ID = /^[0-9a-f]{16}$/;
/** A session id naming its owner: the routing id, a dot, the rest. */
const OWNED_SESSION = /^([0-9a-f]{16})\.(.+)$/s;

/** A fresh routing id for this worker process (never reused: a restarted worker gets another). */
export function newRoutingId(): string {
  return randomBytes(8).toString('hex');
}

export function isRoutingId(value: unknown): value is string {
  return typeof value === 'string' && ROUTING_ID.test(value);
}

/** A session id that names `owner` (none: a single-process server's id, as it was). */
export function ownedSessionId(owner: string | undefined, localId: string): string {
  return owner === undefined ? localId : `${owner}.${localId}`;
}

/** The routing id a session id names, or undefined when it names none. */
export function ownerOf(sessionId: string): string | undefined {
  return OWNED_SESSION.exec(sessionId)?.[1];
}

/** What a worker's router knows: itself, the restore's tables, and the owners found gone. */
export interface RoutingTables {
  /** This worker's routing id. */
  readonly self: string;
  /** Pre-crash owner → the live worker that holds its sessions now. */
  readonly aliases: ReadonlyMap<string, string>;
  /** Restored session that names no owner → the live worker that holds it. */
  readonly placements: ReadonlyMap<string, string>;
  /** Owners whose socket refused a connection: their worker is gone, and its sessions with it. */
  readonly gone: ReadonlySet<string>;
}

/**
 * The worker a request on `sessionId` belongs to, or undefined to serve it here: no session (a
 * new one is seeded here), this worker's own, or nothing resolves it to a live worker (served as
 * a new session would be). An owner is resolved through the alias table first (its worker died),
 * an id without one through the placement table.
 */
export function sessionTarget(
  sessionId: string | undefined,
  tables: RoutingTables,
): string | undefined {
  if (sessionId === undefined) return undefined;
  const owner = ownerOf(sessionId);
  const target =
    owner === undefined ? tables.placements.get(sessionId) : (tables.aliases.get(owner) ?? owner);
  if (target === undefined || target === tables.self || tables.gone.has(target)) return undefined;
  return target;
}
