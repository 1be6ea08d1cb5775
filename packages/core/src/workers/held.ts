/**
 * The restored records a coordinator holds for its workers to claim: state that lives inside one
 * request (an environment episode's `/run`, an agent's legacy `/run`), kept by the capture key of
 * the attempt that continues it (its claim key) until the worker that receives that attempt's
 * request claims it. Each record is kept as read from the checkpoint, naming the attempt it
 * replaces; `inScope` re-exports it as its next attempt, as the one-process participant does.
 */
import { captureKey, covers, type EpisodeId, nextAttempt } from '../identity.js';
import type { CheckpointRecord } from '../store.js';

/** The key a held record is claimed by: its replacement attempt's capture key. */
export function claimKeyOf(record: CheckpointRecord): string {
  return captureKey(nextAttempt(record.episode_id));
}

/** `record` under another episode, its other fields (getters too: nothing decoded) as they are. */
export function recordAs<R extends CheckpointRecord>(record: R, episode: EpisodeId): R {
  const copy = Object.create(
    Object.getPrototypeOf(record) as object | null,
    Object.getOwnPropertyDescriptors(record),
  ) as R;
  copy.episode_id = episode;
  return copy;
}

export class HeldRecords<R extends CheckpointRecord = CheckpointRecord> {
  readonly #byKey = new Map<string, R>();
  /** Claim keys by rollout: a retire looks at its rollout's records only. */
  readonly #byRollout = new Map<string, Set<string>>();

  get size(): number {
    return this.#byKey.size;
  }

  /** Claim keys, sorted (what a worker adopts: it claims only these). */
  keys(): string[] {
    return [...this.#byKey.keys()].sort();
  }

  has(key: string): boolean {
    return this.#byKey.has(key);
  }

  /** Holds `records` (the restore's, each naming the attempt it replaces). */
  hold(records: Iterable<R>): void {
    for (const record of records) {
      const key = claimKeyOf(record);
      this.#byKey.set(key, record);
      let keys = this.#byRollout.get(record.episode_id.rollout_id);
      if (keys === undefined) {
        keys = new Set();
        this.#byRollout.set(record.episode_id.rollout_id, keys);
      }
      keys.add(key);
    }
  }

  /** Takes the record out: it is the claimer's now. Undefined when none is held (any more). */
  claim(key: string): R | undefined {
    const record = this.#byKey.get(key);
    if (record !== undefined) this.#drop(key, record);
    return record;
  }

  /** The replacement attempts no request has claimed yet. */
  pending(): EpisodeId[] {
    return [...this.#byKey.values()].map((r) => nextAttempt(r.episode_id));
  }

  /**
   * The records a commit exports again: those whose replacement `scope` (capture keys; null: all)
   * names, each under its replacement, so a second crash still continues it.
   */
  inScope(scope: ReadonlySet<string> | null): R[] {
    const records: R[] = [];
    for (const [key, record] of this.#byKey) {
      if (scope === null || scope.has(key)) {
        records.push(recordAs(record, nextAttempt(record.episode_id)));
      }
    }
    return records;
  }

  /** Drops the records whose replacement `episode` covers (it and earlier attempts); returns how many. */
  retire(episode: EpisodeId): number {
    let dropped = 0;
    for (const key of [...(this.#byRollout.get(episode.rollout_id) ?? [])]) {
      const record = this.#byKey.get(key)!;
      if (covers(episode, nextAttempt(record.episode_id))) {
        this.#drop(key, record);
        dropped += 1;
      }
    }
    return dropped;
  }

  #drop(key: string, record: R): void {
    this.#byKey.delete(key);
    const rollout = record.episode_id.rollout_id;
    const keys = this.#byRollout.get(rollout);
    keys?.delete(key);
    if (keys?.size === 0) this.#byRollout.delete(rollout);
  }
}
