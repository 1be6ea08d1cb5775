/**
 * The policy gate: admission of generation calls, tickets for admitted calls, and held responses.
 *
 * - A call that arrives while a checkpoint is open waits at admission, without a ticket: it is
 *   not counted, never blocks readiness and is never exported. Its agent is still at the boundary
 *   it recorded before the call.
 * - An admitted call holds a ticket until it leaves. Its response is held at its first chunk of
 *   answer data while admission is closed; once started it streams to the end, and only started
 *   responses block readiness.
 * - Retired marks refuse a call `stale_attempt`. Raising a mark flags every call of a covered
 *   attempt still waiting at admission as refused for good, and wakes it — so a retire cut short
 *   by its deadline, or forgotten before admission reopens, still refuses the call.
 */
import { randomUUID } from 'node:crypto';

import {
  covers,
  type EpisodeId,
  RetiredMarks,
  StaleAttemptError,
  captureKey as keyOf,
} from '@ckpt-gym/core';

/** The marks of the gate's participant: raising one refuses the covered waiting calls at once. */
export class GateMarks extends RetiredMarks {
  constructor(private readonly onMark: (episodes: readonly EpisodeId[]) => void) {
    super();
  }

  override mark(episodes: Iterable<EpisodeId>): number {
    const list = [...episodes];
    const count = super.mark(list);
    this.onMark(list);
    return count;
  }
}

/** One admitted generation call. */
export interface Ticket {
  /** The call's `model_call_id` (also the ledger row's id). */
  readonly id: string;
  /** Undefined for an untagged call (no `/ng-rollout` prefix): never attributed, never retired. */
  readonly episode: EpisodeId | undefined;
  readonly captureKey: string | undefined;
  /** Wall-clock seconds. */
  readonly admittedAt: number;
  /** Aborted when a retire cancels the call (its reason is a `StaleAttemptError`). */
  readonly signal: AbortSignal;
  readonly responseStarted: boolean;
}

interface LiveTicket extends Ticket {
  responseStarted: boolean;
  cancel: AbortController;
  cancelled: boolean;
  /** Resolves when the ticket left the gate. */
  left: Promise<void>;
  leave: () => void;
}

interface Waiter {
  readonly episode: EpisodeId;
  refused: boolean;
  left: Promise<void>;
}

/** Resolves on the next `fire()`; a fresh one replaces it each time. */
class Signal {
  #promise!: Promise<void>;
  #resolve!: () => void;

  constructor() {
    this.#reset();
  }

  #reset(): void {
    this.#promise = new Promise<void>((resolve) => (this.#resolve = resolve));
  }

  get next(): Promise<void> {
    return this.#promise;
  }

  fire(): void {
    const resolve = this.#resolve;
    this.#reset();
    resolve();
  }
}

/** Waits for `wake`, or rejects with the signal's reason once it aborts. */
function waitFor(wake: Promise<void>, signal: AbortSignal | undefined): Promise<void> {
  if (!signal) return wake;
  signal.throwIfAborted();
  return new Promise<void>((resolve, reject) => {
    const onAbort = () => {
      reject(signal.reason instanceof Error ? signal.reason : new Error('request aborted'));
    };
    signal.addEventListener('abort', onAbort, { once: true });
    void wake.then(() => {
      signal.removeEventListener('abort', onAbort);
      resolve();
    });
  });
}

export function staleAttempt(key: string): StaleAttemptError {
  return new StaleAttemptError(`attempt ${key} was retired; this call is refused`);
}

export class PolicyGate {
  readonly marks: GateMarks;
  #accepting = true;
  readonly #changed = new Signal();
  readonly #tickets = new Set<LiveTicket>();
  /** Tagged tickets by rollout id, so a retire finds its calls without scanning. */
  readonly #ticketsByRollout = new Map<string, Set<LiveTicket>>();
  /** Calls waiting at closed admission, by rollout id. */
  readonly #waiting = new Map<string, Set<Waiter>>();
  /** Started responses per capture key ('' for untagged calls). */
  readonly #streaming = new Map<string, number>();
  #streamingCount = 0;
  #served = false;

  constructor(private readonly onChange: () => void = () => undefined) {
    this.marks = new GateMarks((episodes) => this.#refuseWaiting(episodes));
  }

  get accepting(): boolean {
    return this.#accepting;
  }

  /** True once any call was admitted (a server that served calls refuses to restore). */
  get served(): boolean {
    return this.#served;
  }

  /**
   * Admits a call: waits while admission is closed, refuses a retired attempt `stale_attempt`
   * (also while waiting), then enters a ticket in the same tick as the last admission check, so no
   * checkpoint can close in between.
   */
  async admit(episode: EpisodeId | undefined, signal?: AbortSignal): Promise<Ticket> {
    let waiter: Waiter | undefined;
    let leave: (() => void) | undefined;
    try {
      for (;;) {
        if (waiter?.refused || (episode && this.marks.isRetired(episode))) {
          throw staleAttempt(keyOf(episode!));
        }
        if (this.#accepting) return this.#enter(episode);
        if (episode && !waiter) {
          const left = new Promise<void>((resolve) => (leave = resolve));
          waiter = { episode, refused: false, left };
          this.#index(this.#waiting, episode.rollout_id).add(waiter);
        }
        await waitFor(this.#changed.next, signal);
      }
    } finally {
      if (waiter) {
        this.#unindex(this.#waiting, waiter.episode.rollout_id, waiter);
        leave?.();
      }
    }
  }

  #index<T>(map: Map<string, Set<T>>, rolloutId: string): Set<T> {
    let set = map.get(rolloutId);
    if (!set) {
      set = new Set();
      map.set(rolloutId, set);
    }
    return set;
  }

  #unindex<T>(map: Map<string, Set<T>>, rolloutId: string, item: T): void {
    const set = map.get(rolloutId);
    if (!set) return;
    set.delete(item);
    if (set.size === 0) map.delete(rolloutId);
  }

  #enter(episode: EpisodeId | undefined): Ticket {
    const cancel = new AbortController();
    let leave!: () => void;
    const left = new Promise<void>((resolve) => (leave = resolve));
    const ticket: LiveTicket = {
      id: randomUUID().replace(/-/g, ''),
      episode,
      captureKey: episode ? keyOf(episode) : undefined,
      admittedAt: Date.now() / 1000,
      signal: cancel.signal,
      responseStarted: false,
      cancel,
      cancelled: false,
      left,
      leave,
    };
    this.#served = true;
    this.#tickets.add(ticket);
    if (episode) this.#index(this.#ticketsByRollout, episode.rollout_id).add(ticket);
    this.onChange();
    return ticket;
  }

  /**
   * Holds the response while admission is closed, then marks it started. A response that started
   * streams to its end whatever happens to admission; until then the ticket is undelivered.
   */
  async deliver(ticket: Ticket, signal?: AbortSignal): Promise<void> {
    const live = ticket as LiveTicket;
    while (!this.#accepting) {
      await waitFor(
        this.#changed.next,
        signal ? AbortSignal.any([signal, live.signal]) : live.signal,
      );
    }
    live.signal.throwIfAborted();
    live.responseStarted = true;
    const key = live.captureKey ?? '';
    this.#streaming.set(key, (this.#streaming.get(key) ?? 0) + 1);
    this.#streamingCount += 1;
    this.onChange();
  }

  /** The ticket leaves the gate (always called once, when the call's work is over). */
  exit(ticket: Ticket): void {
    const live = ticket as LiveTicket;
    if (!this.#tickets.delete(live)) return;
    if (live.episode) this.#unindex(this.#ticketsByRollout, live.episode.rollout_id, live);
    if (live.responseStarted) {
      const key = live.captureKey ?? '';
      const count = (this.#streaming.get(key) ?? 1) - 1;
      if (count === 0) this.#streaming.delete(key);
      else this.#streaming.set(key, count);
      this.#streamingCount -= 1;
    }
    live.leave();
    this.onChange();
  }

  close(): void {
    this.#accepting = false;
  }

  open(): void {
    this.#accepting = true;
    this.#changed.fire();
  }

  #refuseWaiting(episodes: readonly EpisodeId[]): void {
    let woke = false;
    for (const e of episodes) {
      for (const waiter of this.#waiting.get(e.rollout_id) ?? []) {
        if (covers(e, waiter.episode)) {
          waiter.refused = true;
          woke = true;
        }
      }
    }
    if (woke) this.#changed.fire();
  }

  /**
   * Stops the calls of `episode` and its earlier attempts: the waiting ones leave refused, the
   * admitted ones are cancelled — each once, so a retried retire waits for a call an earlier
   * retire cancelled without cancelling it again. Resolves once all of them left the gate.
   * Untagged calls are never touched.
   */
  async retire(episode: EpisodeId): Promise<void> {
    this.#refuseWaiting([episode]);
    const leaving: Promise<void>[] = [];
    for (const waiter of this.#waiting.get(episode.rollout_id) ?? []) {
      if (covers(episode, waiter.episode)) leaving.push(waiter.left);
    }
    for (const ticket of this.#ticketsByRollout.get(episode.rollout_id) ?? []) {
      if (!ticket.episode || !covers(episode, ticket.episode)) continue;
      if (!ticket.cancelled) {
        ticket.cancelled = true;
        ticket.cancel.abort(staleAttempt(ticket.captureKey ?? ''));
      }
      leaving.push(ticket.left);
    }
    await Promise.all(leaving);
  }

  /** No response is streaming. Cheap. */
  get ready(): boolean {
    return this.#streamingCount === 0;
  }

  /** Capture keys with a started response ('' stands for untagged calls), sorted. */
  streamingKeys(): string[] {
    return [...this.#streaming.keys()].sort();
  }

  get streamingKeyCount(): number {
    return this.#streaming.size;
  }

  get inflight(): number {
    return this.#tickets.size;
  }

  /** Admitted calls whose response has not started. */
  get held(): number {
    return this.#tickets.size - this.#streamingCount;
  }

  /** The ids of admitted tagged calls whose response has not started (they have no ledger row). */
  undeliveredCallIds(): Set<string> {
    const ids = new Set<string>();
    for (const ticket of this.#tickets) {
      if (ticket.captureKey !== undefined && !ticket.responseStarted) ids.add(ticket.id);
    }
    return ids;
  }

  /** How many calls wait at closed admission (for tests and status). */
  get waitingCount(): number {
    let count = 0;
    for (const set of this.#waiting.values()) count += set.size;
    return count;
  }
}
