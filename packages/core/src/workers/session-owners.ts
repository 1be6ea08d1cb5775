/**
 * Who owns a session, as small pure rules. A server with several workers keeps each session in
 * the memory of the worker that seeded it; every worker has a random routing id, and what the
 * client keeps for a session (a signed cookie, an MCP token) names it beside the session id: the
 * session id itself is left as it is (a native session's id is its caller's). A restore moves each
 * pre-crash owner's sessions to one live worker (the alias table) and places sessions that name no
 * owner (checkpointed by a single-process server) one by one (the placement table, by session
 * id). docs/workers.md.
 */
import { randomBytes } from 'node:crypto';

/** 16 lowercase hex digits: 64 random bits per worker process. */
const ROUTING_ID = /^[0-9a-f]{16}$/;
/** A signed name of a session with its owner: the routing id, a dot, the session id. */
const OWNED_NAME = /^([0-9a-f]{16})\.(.+)$/s;

/** A fresh routing id for this worker process (never reused: a restarted worker gets another). */
export function newRoutingId(): string {
  return randomBytes(8).toString('hex');
}

export function isRoutingId(value: unknown): value is string {
  return typeof value === 'string' && ROUTING_ID.test(value);
}

/** A session as a request names it: its id, and the worker that owns it when it names one. */
export interface SessionRef {
  readonly id: string;
  readonly owner?: string | undefined;
}

/** The text a cookie signs for a session: `<owner>.<id>`, or the id alone without an owner. */
export function ownedName(ref: SessionRef): string {
  return ref.owner === undefined ? ref.id : `${ref.owner}.${ref.id}`;
}

/** The session a signed text names (`ownedName`'s inverse; a single-process cookie names no owner). */
export function parseOwnedName(text: string): SessionRef {
  const match = OWNED_NAME.exec(text);
  return match ? { id: match[2]!, owner: match[1]! } : { id: text };
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
 * The worker a request on `session` belongs to, or undefined to serve it here: no session (a new
 * one is seeded here), this worker's own, or nothing resolves it to a live worker (served as a
 * new session would be). An owner is resolved through the alias table first (its worker died), a
 * session without one through the placement table.
 */
export function sessionTarget(
  session: SessionRef | undefined,
  tables: RoutingTables,
): string | undefined {
  if (session === undefined) return undefined;
  const { owner } = session;
  const target =
    owner === undefined ? tables.placements.get(session.id) : (tables.aliases.get(owner) ?? owner);
  if (target === undefined || target === tables.self || tables.gone.has(target)) return undefined;
  return target;
}
