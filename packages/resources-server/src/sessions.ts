/**
 * The participant's session table: which attempt each session belongs to, with an index by rollout
 * (retire and forget visit only a rollout's own sessions) and one by restored-pending episode
 * (commit cleanup visits only that episode's sessions). Counts are kept as sessions change, so
 * readiness never scans.
 */
import { captureKey, type EpisodeId, sameEpisode } from '@ckpt-gym/core/protocol';

export interface TrackedSession {
  readonly id: string;
  episode: EpisodeId;
  key: string;
  /** Requests running on this session right now (retire drains them). */
  inflight: number;
  /** Refused from the moment its attempt was marked retired until it is freed. */
  fenced: boolean;
  /** Installed by a restore: a request on it must name its attempt. */
  readonly restored: boolean;
  /** Restored and not yet used by any request. */
  pending: boolean;
}

function addTo<K, V>(index: Map<K, Set<V>>, key: K, value: V): void {
  let set = index.get(key);
  if (!set) {
    set = new Set();
    index.set(key, set);
  }
  set.add(value);
}

function removeFrom<K, V>(index: Map<K, Set<V>>, key: K, value: V): void {
  const set = index.get(key);
  if (!set) return;
  set.delete(value);
  if (set.size === 0) index.delete(key);
}

export class SessionTable {
  readonly #byId = new Map<string, TrackedSession>();
  readonly #byRollout = new Map<string, Set<string>>();
  readonly #pendingByKey = new Map<string, Set<string>>();
  #fenced = 0;

  /** Hears each restored episode's key once it holds no pending session. */
  readonly #onPendingLeft: (key: string) => void;

  constructor(onPendingLeft: (key: string) => void) {
    this.#onPendingLeft = onPendingLeft;
  }

  get size(): number {
    return this.#byId.size;
  }

  /** Tracked sessions whose attempt was retired and that are not freed yet. */
  get fencedCount(): number {
    return this.#fenced;
  }

  get(id: string): TrackedSession | undefined {
    return this.#byId.get(id);
  }

  all(): IterableIterator<TrackedSession> {
    return this.#byId.values();
  }

  /**
   * Tracks `id` under `episode`. An id already tracked keeps its object (and its in-flight count)
   * and moves to the new episode.
   */
  bind(
    id: string,
    episode: EpisodeId,
    flags: { restored?: boolean; fenced?: boolean } = {},
  ): TrackedSession {
    let session = this.#byId.get(id);
    if (session) {
      if (!sameEpisode(session.episode, episode)) {
        this.claim(session);
        removeFrom(this.#byRollout, session.episode.rollout_id, id);
        session.episode = episode;
        session.key = captureKey(episode);
        addTo(this.#byRollout, episode.rollout_id, id);
      }
    } else {
      session = {
        id,
        episode,
        key: captureKey(episode),
        inflight: 0,
        fenced: false,
        restored: flags.restored ?? false,
        pending: flags.restored ?? false,
      };
      this.#byId.set(id, session);
      addTo(this.#byRollout, episode.rollout_id, id);
      if (session.pending) addTo(this.#pendingByKey, session.key, id);
    }
    if (flags.fenced) this.fence(session);
    return session;
  }

  remove(id: string): TrackedSession | undefined {
    const session = this.#byId.get(id);
    if (!session) return undefined;
    this.#byId.delete(id);
    removeFrom(this.#byRollout, session.episode.rollout_id, id);
    if (session.pending) this.#unpend(session);
    if (session.fenced) this.#fenced -= 1;
    return session;
  }

  fence(session: TrackedSession): void {
    if (session.fenced) return;
    session.fenced = true;
    this.#fenced += 1;
    this.claim(session);
  }

  /** A request used a restored session: it is no longer pending. */
  claim(session: TrackedSession): void {
    if (!session.pending) return;
    session.pending = false;
    this.#unpend(session);
  }

  #unpend(session: TrackedSession): void {
    removeFrom(this.#pendingByKey, session.key, session.id);
    if (!this.#pendingByKey.has(session.key)) this.#onPendingLeft(session.key);
  }

  /** Sessions of `rolloutId` at attempt `atMost` or earlier. */
  ofRollout(rolloutId: string, atMost: number): TrackedSession[] {
    const ids = this.#byRollout.get(rolloutId);
    if (!ids) return [];
    const found: TrackedSession[] = [];
    for (const id of ids) {
      const session = this.#byId.get(id);
      if (session && session.episode.attempt <= atMost) found.push(session);
    }
    return found;
  }

  /** Unclaimed restored sessions of exactly this episode. */
  pendingOf(episode: EpisodeId): TrackedSession[] {
    const ids = this.#pendingByKey.get(captureKey(episode));
    return ids ? [...ids].map((id) => this.#byId.get(id) as TrackedSession) : [];
  }

  /** The episodes that hold unclaimed restored sessions. */
  pendingEpisodes(): EpisodeId[] {
    const episodes: EpisodeId[] = [];
    for (const ids of this.#pendingByKey.values()) {
      const first = ids.values().next().value as string;
      episodes.push((this.#byId.get(first) as TrackedSession).episode);
    }
    return episodes;
  }
}
