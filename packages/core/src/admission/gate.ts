/**
 * The admission gate: the one mechanism through which every data-plane participant admits work.
 * A checkpoint closes it and resume opens it; a request asks its kind's pure rule (`rules.ts`)
 * whether it is admitted, waits for resume (abortable by the request's signal) or is refused;
 * admitted work holds a ticket, counted by key (a capture key, '' for untagged work) and by tag
 * (what kind of work: a seed, a call), until it leaves; `retire(episode)` aborts the tickets of the
 * attempt and its earlier ones and waits for them to leave.
 *
 * The seam for several workers per server: a worker's gate reports what it holds as `snapshot()`,
 * a plain JSON-serialisable object (whether it is open, how much is in flight and waiting, by key
 * and tag), and `onChange` tells an observer when to send a fresh one, so a coordinator in another
 * process can add up the workers' readiness without reaching into them.
 */
import { type CkptGymError, StaleAttemptError } from '../errors.js';
import { captureKey, covers, type EpisodeId } from '../identity.js';
import type { Decision } from './rules.js';

/** What the gate tells a rule about itself. */
export interface GateView {
  readonly open: boolean;
  /** `refuseWaiting` refused this waiting request; it stays refused (a forget does not undo it). */
  readonly refused: boolean;
}

/** A request's rule, bound to its participant's state; asked again on every wake-up. */
export type GateRule = (gate: GateView) => Decision;

export interface EnterOptions {
  readonly episode?: EpisodeId;
  /** What the ticket is counted under; by default its capture key ('' for untagged work). */
  readonly key?: string | (() => string);
  /** The kind of work, for counts and for retiring one kind at a time. */
  readonly tag?: string;
}

export interface AdmitOptions extends EnterOptions {
  readonly rule: GateRule;
  /** Stops the wait (the client went away): the request then leaves with the signal's reason. */
  readonly signal?: AbortSignal;
}

/** One piece of admitted work. */
export interface AdmissionTicket {
  readonly episode: EpisodeId | undefined;
  readonly key: string;
  readonly tag: string;
  /** Aborted when a retire stops the work (its reason is a `stale_attempt` error). */
  readonly signal: AbortSignal;
  /** Resolves once the ticket left the gate. */
  readonly left: Promise<void>;
}

/** The gate's counts and readiness as plain JSON: what a worker reports to its coordinator. */
export interface GateSnapshot {
  readonly open: boolean;
  /** True once anything was admitted (a server that served requests refuses a restore). */
  readonly served: boolean;
  readonly inFlight: number;
  readonly waiting: number;
  /** Waiting requests that named no attempt (no retire refuses them). */
  readonly waitingUntagged: number;
  /** In-flight tickets by key (non-zero counts only). */
  readonly byKey: Record<string, number>;
  /** In-flight tickets by tag (non-zero counts only). */
  readonly byTag: Record<string, number>;
}

export interface AdmissionGateOptions {
  /** The reason a retire aborts a ticket with; by default `attempt <key> was retired`. */
  retiredError?: (ticket: AdmissionTicket) => CkptGymError;
}

/**
 * A ticket whose signal and `left` promise are made when first read: most tickets are never
 * aborted or waited for, and an AbortController per request is the gate's largest cost.
 */
class LiveTicket implements AdmissionTicket {
  #controller: AbortController | undefined;
  #left: Promise<void> | undefined;
  #settle: (() => void) | undefined;
  #gone = false;

  constructor(
    readonly episode: EpisodeId | undefined,
    readonly key: string,
    readonly tag: string,
  ) {}

  get signal(): AbortSignal {
    this.#controller ??= new AbortController();
    return this.#controller.signal;
  }

  get left(): Promise<void> {
    if (this.#left === undefined) {
      this.#left = this.#gone
        ? Promise.resolve()
        : new Promise<void>((resolve) => (this.#settle = resolve));
    }
    return this.#left;
  }

  /** Only the first abort counts. */
  abort(reason: Error): void {
    this.#controller ??= new AbortController();
    if (!this.#controller.signal.aborted) this.#controller.abort(reason);
  }

  settle(): void {
    this.#gone = true;
    this.#settle?.();
  }
}

interface Waiter {
  readonly episode: EpisodeId | undefined;
  refused: boolean;
  readonly left: Promise<void>;
  readonly settle: () => void;
}

const DEFAULT_TAG = 'request';

/**
 * Resolves on the next `fire()`; a fresh one replaces it each time. The promise is made when
 * someone waits: every ticket leaving fires, and most leave with nobody waiting.
 */
class Wakeup {
  #promise: Promise<void> | undefined;
  #resolve: (() => void) | undefined;

  get next(): Promise<void> {
    this.#promise ??= new Promise<void>((resolve) => (this.#resolve = resolve));
    return this.#promise;
  }

  fire(): void {
    const resolve = this.#resolve;
    this.#promise = undefined;
    this.#resolve = undefined;
    resolve?.();
  }
}

function abortReason(signal: AbortSignal): Error {
  return signal.reason instanceof Error ? signal.reason : new Error('request aborted');
}

/** Waits for `wake`, or rejects with the signal's reason once it aborts. */
function waitFor(wake: Promise<void>, signal: AbortSignal | undefined): Promise<void> {
  if (!signal) return wake;
  if (signal.aborted) return Promise.reject(abortReason(signal));
  return new Promise<void>((resolve, reject) => {
    const onAbort = () => reject(abortReason(signal));
    signal.addEventListener('abort', onAbort, { once: true });
    void wake.then(() => {
      signal.removeEventListener('abort', onAbort);
      resolve();
    });
  });
}

function settled(): { promise: Promise<void>; settle: () => void } {
  let settle!: () => void;
  const promise = new Promise<void>((resolve) => (settle = resolve));
  return { promise, settle };
}

function addTo<T>(map: Map<string, Set<T>>, key: string, item: T): void {
  let set = map.get(key);
  if (!set) {
    set = new Set();
    map.set(key, set);
  }
  set.add(item);
}

function deleteFrom<T>(map: Map<string, Set<T>>, key: string, item: T): void {
  const set = map.get(key);
  if (!set) return;
  set.delete(item);
  if (set.size === 0) map.delete(key);
}

function count(map: Map<string, number>, key: string, by: number): void {
  const next = (map.get(key) ?? 0) + by;
  if (next === 0) map.delete(key);
  else map.set(key, next);
}

export class AdmissionGate {
  #open = true;
  #served = false;
  /** Wakes the requests waiting at admission (open, `wake`, `refuseWaiting`). */
  readonly #reopened = new Wakeup();
  /** Wakes `until` (any ticket leaving, open, `wake`). */
  readonly #changed = new Wakeup();
  readonly #byTag = new Map<string, Set<LiveTicket>>();
  readonly #byRollout = new Map<string, Set<LiveTicket>>();
  readonly #byKey = new Map<string, number>();
  #inFlight = 0;
  readonly #waitersByRollout = new Map<string, Set<Waiter>>();
  #waiting = 0;
  #waitingUntagged = 0;
  readonly #listeners = new Set<() => void>();
  readonly #retiredError: (ticket: AdmissionTicket) => CkptGymError;

  constructor(options: AdmissionGateOptions = {}) {
    this.#retiredError =
      options.retiredError ?? ((t) => new StaleAttemptError(`attempt ${t.key} was retired`));
  }

  get isOpen(): boolean {
    return this.#open;
  }

  get served(): boolean {
    return this.#served;
  }

  get inFlight(): number {
    return this.#inFlight;
  }

  get waiting(): number {
    return this.#waiting;
  }

  get waitingUntagged(): number {
    return this.#waitingUntagged;
  }

  /** A checkpoint closes admission: rules that wait make new requests wait. */
  close(): void {
    this.#open = false;
    this.#notify();
  }

  /** Resume: waiting requests ask their rules again. */
  open(): void {
    this.#open = true;
    this.wake();
    this.#notify();
  }

  /** State a rule or an `until` reads outside the gate changed: every waiter checks again. */
  wake(): void {
    this.#reopened.fire();
    this.#changed.fire();
  }

  /** Subscribes to changes of the snapshot; returns the unsubscribe function. */
  onChange(listener: () => void): () => void {
    this.#listeners.add(listener);
    return () => this.#listeners.delete(listener);
  }

  #notify(): void {
    for (const listener of this.#listeners) listener();
  }

  // --- admission ----------------------------------------------------------------------------

  /**
   * Admits one request by its rule: waits while it says wait (counted as waiting, never in
   * flight), throws its refusal, and enters the ticket in the same tick as the rule's admit, so
   * no checkpoint can close in between. `then` runs in that tick too, with the new ticket.
   */
  admit(options: AdmitOptions): Promise<AdmissionTicket>;
  admit<T>(options: AdmitOptions, then: (ticket: AdmissionTicket) => T): Promise<T>;
  admit<T>(
    options: AdmitOptions,
    then?: (ticket: AdmissionTicket) => T,
  ): Promise<T | AdmissionTicket> {
    return this.#decide(options, () => {
      const ticket = this.enter(options);
      return then ? then(ticket) : ticket;
    });
  }

  /** As `admit`, for a request that holds no ticket (it neither blocks nor is retired). */
  pass(options: AdmitOptions): Promise<void>;
  pass<T>(options: AdmitOptions, then: () => T): Promise<T>;
  pass<T>(options: AdmitOptions, then?: () => T): Promise<T | void> {
    return this.#decide(options, () => {
      this.#served = true;
      return then?.();
    });
  }

  /** Admits, runs `work` under the ticket, and leaves whatever happens. */
  async run<T>(options: AdmitOptions, work: (ticket: AdmissionTicket) => Promise<T>): Promise<T> {
    const ticket = await this.admit(options);
    try {
      return await work(ticket);
    } finally {
      this.leave(ticket);
    }
  }

  /** The rule's first answer; only a request told to wait runs the waiting loop (`#wait`). */
  #decide<T>(options: AdmitOptions, onAdmit: () => T): Promise<T> {
    try {
      const decision = options.rule({ open: this.#open, refused: false });
      // The usual answers settle here: no async frame, no waiter, for most requests.
      if (decision.kind === 'admit') return Promise.resolve(onAdmit());
      if (decision.kind === 'refuse') return Promise.reject(decision.error);
    } catch (err) {
      return Promise.reject(err as Error);
    }
    return this.#wait(options, onAdmit);
  }

  /** Waits as a waiter, asking the rule again at each wake-up, until it admits or refuses. */
  async #wait<T>(options: AdmitOptions, onAdmit: () => T): Promise<T> {
    const waiter = this.#addWaiter(options.episode);
    try {
      for (;;) {
        await waitFor(this.#reopened.next, options.signal);
        const decision = options.rule({ open: this.#open, refused: waiter.refused });
        if (decision.kind === 'refuse') throw decision.error;
        if (decision.kind === 'admit') return onAdmit();
      }
    } finally {
      this.#removeWaiter(waiter);
    }
  }

  /** Resolves once admission is open (at once when it is), or rejects when `signal` aborts. */
  async waitOpen(signal?: AbortSignal): Promise<void> {
    while (!this.#open) await waitFor(this.#reopened.next, signal);
  }

  /** Waits until `predicate` holds, checked again each time a ticket leaves or the gate wakes. */
  async until(predicate: () => boolean, signal?: AbortSignal): Promise<void> {
    while (!predicate()) await waitFor(this.#changed.next, signal);
  }

  #addWaiter(episode: EpisodeId | undefined): Waiter {
    const { promise, settle } = settled();
    const waiter: Waiter = { episode, refused: false, left: promise, settle };
    this.#waiting += 1;
    if (episode) addTo(this.#waitersByRollout, episode.rollout_id, waiter);
    else this.#waitingUntagged += 1;
    this.#notify();
    return waiter;
  }

  #removeWaiter(waiter: Waiter): void {
    this.#waiting -= 1;
    if (waiter.episode) deleteFrom(this.#waitersByRollout, waiter.episode.rollout_id, waiter);
    else this.#waitingUntagged -= 1;
    waiter.settle();
    this.#notify();
  }

  /**
   * Refuses, for good, the waiting requests of `episodes` and their earlier attempts, and wakes
   * them (their rules see `refused`); resolves once they left.
   */
  refuseWaiting(episodes: readonly EpisodeId[]): Promise<void> {
    const leaving: Promise<void>[] = [];
    for (const e of episodes) {
      for (const waiter of this.#waitersByRollout.get(e.rollout_id) ?? []) {
        if (!covers(e, waiter.episode!)) continue;
        waiter.refused = true;
        leaving.push(waiter.left);
      }
    }
    if (leaving.length > 0) this.#reopened.fire();
    return Promise.all(leaving).then(() => undefined);
  }

  // --- tickets ------------------------------------------------------------------------------

  /** Enters a ticket without asking a rule (the caller decided already, in this tick). */
  enter(options: EnterOptions = {}): AdmissionTicket {
    const { episode } = options;
    const key =
      typeof options.key === 'function'
        ? options.key()
        : (options.key ?? (episode ? captureKey(episode) : ''));
    const ticket = new LiveTicket(episode, key, options.tag ?? DEFAULT_TAG);
    this.#served = true;
    this.#inFlight += 1;
    addTo(this.#byTag, ticket.tag, ticket);
    if (episode) addTo(this.#byRollout, episode.rollout_id, ticket);
    count(this.#byKey, key, 1);
    this.#notify();
    return ticket;
  }

  /** The ticket leaves the gate; a second call changes nothing. */
  leave(ticket: AdmissionTicket): void {
    const live = ticket as LiveTicket;
    const tagged = this.#byTag.get(live.tag);
    if (!tagged?.has(live)) return;
    deleteFrom(this.#byTag, live.tag, live);
    if (live.episode) deleteFrom(this.#byRollout, live.episode.rollout_id, live);
    count(this.#byKey, live.key, -1);
    this.#inFlight -= 1;
    live.settle();
    this.#changed.fire();
    this.#notify();
  }

  /** The in-flight tickets, of one tag or all. */
  tickets(tag?: string): Iterable<AdmissionTicket> {
    if (tag !== undefined) return this.#byTag.get(tag) ?? [];
    return [...this.#byTag.values()].flatMap((set) => [...set]);
  }

  /** How many tickets are in flight, of one tag or all. */
  count(tag?: string): number {
    return tag === undefined ? this.#inFlight : (this.#byTag.get(tag)?.size ?? 0);
  }

  /** How many tickets are in flight under `key`. */
  countOf(key: string): number {
    return this.#byKey.get(key) ?? 0;
  }

  /** In-flight counts by key. */
  keys(): ReadonlyMap<string, number> {
    return this.#byKey;
  }

  /** The tickets of `episode` and its earlier attempts (of one tag, or all). */
  covered(episode: EpisodeId, tag?: string): AdmissionTicket[] {
    const out: AdmissionTicket[] = [];
    for (const ticket of this.#byRollout.get(episode.rollout_id) ?? []) {
      if ((tag === undefined || ticket.tag === tag) && covers(episode, ticket.episode!)) {
        out.push(ticket);
      }
    }
    return out;
  }

  /** True while a ticket of `episode` or an earlier attempt is in flight. */
  holds(episode: EpisodeId, tag?: string): boolean {
    return this.covered(episode, tag).length > 0;
  }

  /** Waits for the covered tickets in flight now to leave, without stopping them. */
  async drain(episode: EpisodeId, tag?: string): Promise<void> {
    await Promise.all(this.covered(episode, tag).map((t) => t.left));
  }

  /**
   * Stops the work of `episode` and its earlier attempts: aborts each covered ticket (once: a
   * retried retire waits for a ticket an earlier one aborted without aborting it again) and waits
   * for them to leave. Untagged work is never touched.
   */
  async retire(episode: EpisodeId, tag?: string): Promise<void> {
    const tickets = this.covered(episode, tag);
    for (const ticket of tickets) this.abort(ticket, this.#retiredError(ticket));
    await Promise.all(tickets.map((t) => t.left));
  }

  /** Stops one ticket's work with `reason`; only the first abort counts. */
  abort(ticket: AdmissionTicket, reason: Error): void {
    (ticket as LiveTicket).abort(reason);
  }

  /** The gate's state as plain JSON (see the file comment). */
  snapshot(): GateSnapshot {
    const byTag: Record<string, number> = {};
    for (const [tag, set] of this.#byTag) byTag[tag] = set.size;
    return {
      open: this.#open,
      served: this.#served,
      inFlight: this.#inFlight,
      waiting: this.#waiting,
      waitingUntagged: this.#waitingUntagged,
      byKey: Object.fromEntries(this.#byKey),
      byTag,
    };
  }
}
