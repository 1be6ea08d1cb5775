/**
 * The coordinator's retired marks. The control plane raises and forgets marks on its participant
 * synchronously; the coordinator's marks relay each change to every worker, and a retire (or a
 * restore's close of admission) first waits for the relays, so every worker refuses the attempt
 * before any of them stops its calls.
 */
import type { EpisodeId } from '../identity.js';
import { RetiredMarks } from '../participant.js';

export interface MarksRelay {
  mark(episodes: readonly EpisodeId[]): Promise<void>;
  forget(rolloutIds: readonly string[]): Promise<void>;
  /** A relay failed with nobody waiting for it. */
  failed(what: 'mark' | 'forget', err: unknown): void;
}

export class RelayedMarks extends RetiredMarks {
  readonly #relay: MarksRelay;
  /** Relays still running, or failed and not yet awaited: each resolves to its failure, or undefined. */
  #pending = new Set<Promise<unknown>>();

  constructor(relay: MarksRelay) {
    super();
    this.#relay = relay;
  }

  override mark(episodes: Iterable<EpisodeId>): number {
    const list = [...episodes];
    const count = super.mark(list);
    if (list.length > 0) this.#track('mark', this.#relay.mark(list));
    return count;
  }

  override forget(rolloutIds: Iterable<string>): number {
    const list = [...new Set(rolloutIds)];
    const count = super.forget(list);
    if (list.length > 0) this.#track('forget', this.#relay.forget(list));
    return count;
  }

  /** Every mark as rollout id → highest retired attempt (what a joining worker adopts). */
  toJson(): Record<string, number> {
    const out: Record<string, number> = {};
    for (const rollout of this.rollouts()) out[rollout] = this.highestRetired(rollout)!;
    return out;
  }

  /** Waits for every relay started so far; throws the first one's failure. */
  async relayed(): Promise<void> {
    const pending = [...this.#pending];
    for (const p of pending) this.#pending.delete(p);
    const failures = (await Promise.all(pending)).filter((f) => f !== undefined);
    const [first] = failures;
    if (first !== undefined) throw first instanceof Error ? first : new Error(String(first));
  }

  #track(what: 'mark' | 'forget', relay: Promise<void>): void {
    const outcome = relay.then(
      () => undefined,
      (err: unknown) => {
        this.#relay.failed(what, err);
        return err;
      },
    );
    this.#pending.add(outcome);
    // A relay that succeeded leaves nothing to report; a failed one stays for the next waiter.
    void outcome.then((failure) => {
      if (failure === undefined) this.#pending.delete(outcome);
    });
  }
}
