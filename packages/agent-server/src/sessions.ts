/**
 * The agent session table the base server holds: seeded sessions by `agent_session_id`, close
 * receipts kept for retries, the signed session cookie, and an index by rollout so work for one
 * rollout (a retire, say) never scans every session.
 */
import { createHmac, timingSafeEqual } from 'node:crypto';

import {
  type AgentSeedRequest,
  CheckpointError,
  type CloseReceipt,
  type EpisodeId,
  encodeJson,
  type JsonObject,
} from '@ckpt-gym/core/protocol';
import { ownedName, parseOwnedName, type SessionRef } from '@ckpt-gym/core/server';

export const AGENT_SESSION_COOKIE = 'agent_session_id';
export const DEFAULT_CLOSE_RETRY_WINDOW_SECONDS = 300;

/** A completed activation's reply, kept as the objects it was sent as (no copy, no encoding). */
export interface StoredReply {
  response: JsonObject;
  cookies: Record<string, string>;
}

/** One seeded session: what the framework needs (activation counts, the kept reply) plus the agent's own state. */
export interface AgentSessionEntry<S = unknown> {
  readonly id: string;
  readonly request: AgentSeedRequest;
  /** The seed body as canonical text: an identical retried seed reuses the session. */
  readonly fingerprint: string;
  /** The attempt that owns the session; a restore moves it to the replacement attempt. */
  episode: EpisodeId;
  /** Activations started (the last one's 1-based index). */
  activations: number;
  /** Index of the last completed activation, 0 for none. */
  completedActivation: number;
  /** That activation's reply; kept only when its request carried an activation index. */
  completedReply: StoredReply | null;
  closing: boolean;
  state: S;
}

const NO_ITEMS: readonly never[] = [];

/**
 * Items grouped by rollout; an entry leaves with the last item of its rollout. A rollout holds one
 * item or a few, so a small array (no Set per rollout) keeps a restore of thousands cheap.
 */
export class RolloutIndex<T> {
  private readonly byRollout = new Map<string, T[]>();

  add(rolloutId: string, item: T): void {
    const items = this.byRollout.get(rolloutId);
    if (!items) this.byRollout.set(rolloutId, [item]);
    else if (!items.includes(item)) items.push(item);
  }

  delete(rolloutId: string, item: T): void {
    const items = this.byRollout.get(rolloutId);
    const at = items ? items.indexOf(item) : -1;
    if (!items || at < 0) return;
    items.splice(at, 1);
    if (items.length === 0) this.byRollout.delete(rolloutId);
  }

  /** The rollout's items themselves: read them only while nothing changes the index. */
  view(rolloutId: string): readonly T[] {
    return this.byRollout.get(rolloutId) ?? NO_ITEMS;
  }

  /** A snapshot of the rollout's items (safe to change the index while iterating it). */
  of(rolloutId: string): T[] {
    return this.byRollout.get(rolloutId)?.slice() ?? [];
  }

  has(rolloutId: string): boolean {
    return this.byRollout.has(rolloutId);
  }

  get rollouts(): number {
    return this.byRollout.size;
  }
}

/**
 * HMAC-signed `agent_session_id` cookie values, so a client cannot name another session. On a
 * worker of a server with several workers the signed text is `<routing id>.<session id>` (core's
 * `ownedName`): the cookie names the worker that owns the session, for the router; a value a
 * single process signed still reads as its session id, with no owner.
 */
export class SessionCookieSigner {
  constructor(
    private readonly secret: string,
    private readonly owner?: string,
  ) {}

  sign(id: string): string {
    const text = ownedName({ id, owner: this.owner });
    return `${text}.${this.mac(text)}`;
  }

  /** The session (and its owner) of a signed value, or undefined when the signature does not match. */
  verifyRef(value: string): SessionRef | undefined {
    const dot = value.lastIndexOf('.');
    if (dot <= 0) return undefined;
    const text = value.slice(0, dot);
    const given = Buffer.from(value.slice(dot + 1));
    const expected = Buffer.from(this.mac(text));
    if (given.length !== expected.length || !timingSafeEqual(given, expected)) return undefined;
    return parseOwnedName(text);
  }

  /** The session id of a signed value, or undefined when the signature does not match. */
  verify(value: string): string | undefined {
    return this.verifyRef(value)?.id;
  }

  private mac(id: string): string {
    return createHmac('sha256', this.secret).update(id).digest('base64url');
  }
}

/** Parses a `Cookie` header into name → value (URL-decoded). */
export function parseCookieHeader(header: string | undefined): Record<string, string> {
  const out: Record<string, string> = {};
  if (!header) return out;
  for (const part of header.split(';')) {
    const eq = part.indexOf('=');
    if (eq <= 0) continue;
    const name = part.slice(0, eq).trim();
    const raw = part.slice(eq + 1).trim();
    try {
      out[name] = decodeURIComponent(raw);
    } catch {
      out[name] = raw;
    }
  }
  return out;
}

/** Merges `Set-Cookie` values into a copy of `jar`. */
export function mergeSetCookies(
  jar: Record<string, string> | null,
  setCookie: string[] | undefined,
): Record<string, string> | null {
  if (!setCookie || setCookie.length === 0) return jar;
  const out = { ...(jar ?? {}) };
  for (const line of setCookie) {
    const pair = line.split(';', 1)[0] ?? '';
    const eq = pair.indexOf('=');
    if (eq > 0) out[pair.slice(0, eq).trim()] = pair.slice(eq + 1).trim();
  }
  return out;
}

/** The session id the request's signed cookie names; a cookie with a bad signature is refused. */
export function sessionIdFromCookie(
  header: string | undefined,
  signer: SessionCookieSigner,
): string | undefined {
  const value = parseCookieHeader(header)[AGENT_SESSION_COOKIE];
  if (value === undefined) return undefined;
  const id = signer.verify(value);
  if (id === undefined) throw new CheckpointError('Invalid agent session marker');
  return id;
}

export class AgentSessionTable<S = unknown> {
  private readonly entries = new Map<string, AgentSessionEntry<S>>();
  /** Restored sessions not used yet: each is built (its state decoded) when first looked up. */
  private readonly restored = new Map<string, () => AgentSessionEntry<S>>();
  private readonly receipts = new Map<
    string,
    { receipt: CloseReceipt; episode: EpisodeId | null; expiresAt: number }
  >();
  /** Seeds being built, by session id: an identical retry joins the first. */
  readonly building = new Map<
    string,
    { fingerprint: string; done: Promise<AgentSessionEntry<S>> }
  >();

  constructor(
    private readonly retryWindowSeconds = DEFAULT_CLOSE_RETRY_WINDOW_SECONDS,
    private readonly now: () => number = () => Date.now() / 1000,
  ) {}

  /** The session; a restored one is built now (a build that throws stays to throw again). */
  get(id: string): AgentSessionEntry<S> | undefined {
    const entry = this.entries.get(id);
    if (entry !== undefined) return entry;
    const build = this.restored.get(id);
    if (build === undefined) return undefined;
    const built = build();
    this.restored.delete(id);
    this.entries.set(id, built);
    return built;
  }

  set(entry: AgentSessionEntry<S>): void {
    this.restored.delete(entry.id);
    this.entries.set(entry.id, entry);
  }

  /** A restored session, built by `build` when first looked up. */
  setRestored(id: string, build: () => AgentSessionEntry<S>): void {
    this.entries.delete(id);
    this.restored.set(id, build);
  }

  delete(id: string): boolean {
    const restored = this.restored.delete(id);
    return this.entries.delete(id) || restored;
  }

  get size(): number {
    return this.entries.size + this.restored.size;
  }

  /** Every session, building the restored ones not built yet. */
  values(): IterableIterator<AgentSessionEntry<S>> {
    for (const id of [...this.restored.keys()]) this.get(id);
    return this.entries.values();
  }

  /** The live receipt of a closed session; an expired one is dropped and reported as expired. */
  receipt(
    id: string,
  ): { receipt: CloseReceipt; episode: EpisodeId | null } | 'expired' | undefined {
    const kept = this.receipts.get(id);
    if (!kept) return undefined;
    if (kept.expiresAt <= this.now()) {
      this.receipts.delete(id);
      return 'expired';
    }
    return kept;
  }

  writeReceipt(receipt: CloseReceipt, episode: EpisodeId | null): void {
    this.pruneReceipts();
    this.receipts.set(receipt.agent_session_id, {
      receipt,
      episode,
      expiresAt: this.now() + this.retryWindowSeconds,
    });
  }

  hasReceipt(id: string): boolean {
    return this.receipts.has(id);
  }

  private pruneReceipts(): void {
    const now = this.now();
    // Insertion order is expiry order (one window for all), so stop at the first live receipt.
    for (const [id, kept] of this.receipts) {
      if (kept.expiresAt > now) break;
      this.receipts.delete(id);
    }
  }
}

/** A canonical text of the seed body, compared to tell an identical retry from a conflicting seed. */
export function seedFingerprint(request: AgentSeedRequest): string {
  return encodeJson(request as unknown as JsonObject);
}
