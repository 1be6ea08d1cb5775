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
 *
 * Admission, waiting, counting and retire are core's `AdmissionGate` applying the model rule
 * (`modelCallAdmission`); this class adds what only the model has: held responses.
 */
import { randomUUID } from 'node:crypto';

import { type EpisodeId, captureKey as keyOf } from '@ckpt-gym/core/protocol';
import {
  AdmissionGate,
  modelCallAdmission,
  RetiredMarks,
  staleCall,
  type AdmissionTicket as GateTicket,
} from '@ckpt-gym/core/server';

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
  exited: boolean;
  readonly admitted: GateTicket;
}

export class PolicyGate {
  readonly marks: GateMarks;
  /** Admission, waiting, in-flight counts and retire; this class adds held responses. */
  readonly admission = new AdmissionGate({ retiredError: (t) => staleCall(t.key) });
  /** Admitted tagged calls whose response has not started (they have no ledger row). */
  readonly #undelivered = new Set<LiveTicket>();
  /** Started responses per capture key ('' for untagged calls). */
  readonly #streaming = new Map<string, number>();
  #streamingCount = 0;

  constructor(private readonly onChange: () => void = () => undefined) {
    this.marks = new GateMarks((episodes) => void this.admission.refuseWaiting(episodes));
  }

  get accepting(): boolean {
    return this.admission.isOpen;
  }

  /** True once any call was admitted (a server that served calls refuses to restore). */
  get served(): boolean {
    return this.admission.served;
  }

  /**
   * Admits a call by the model rule (`modelCallAdmission`): waits while admission is closed,
   * refuses a retired attempt `stale_attempt` (also while waiting), then enters a ticket in the
   * same tick as the last admission check, so no checkpoint can close in between.
   */
  admit(episode: EpisodeId | undefined, signal?: AbortSignal): Promise<Ticket> {
    const key = episode ? keyOf(episode) : undefined;
    return this.admission.admit(
      {
        episode,
        signal,
        tag: 'call',
        rule: (gate) =>
          modelCallAdmission({
            open: gate.open,
            key,
            retired: gate.refused || (episode !== undefined && this.marks.isRetired(episode)),
          }),
      },
      (admitted) => this.#enter(admitted, key),
    );
  }

  #enter(admitted: GateTicket, key: string | undefined): Ticket {
    const ticket: LiveTicket = {
      id: randomUUID().replace(/-/g, ''),
      episode: admitted.episode,
      captureKey: key,
      admittedAt: Date.now() / 1000,
      signal: admitted.signal,
      responseStarted: false,
      exited: false,
      admitted,
    };
    if (key !== undefined) this.#undelivered.add(ticket);
    this.onChange();
    return ticket;
  }

  /**
   * Holds the response while admission is closed, then marks it started. A response that started
   * streams to its end whatever happens to admission; until then the ticket is undelivered.
   */
  async deliver(ticket: Ticket, signal?: AbortSignal): Promise<void> {
    const live = ticket as LiveTicket;
    // Open (the usual case): nothing to wait for, so no combined signal is built (costly).
    if (!this.admission.isOpen) {
      await this.admission.waitOpen(signal ? AbortSignal.any([signal, live.signal]) : live.signal);
    }
    live.signal.throwIfAborted();
    live.responseStarted = true;
    this.#undelivered.delete(live);
    const key = live.captureKey ?? '';
    this.#streaming.set(key, (this.#streaming.get(key) ?? 0) + 1);
    this.#streamingCount += 1;
    this.onChange();
  }

  /** The ticket leaves the gate (always called once, when the call's work is over). */
  exit(ticket: Ticket): void {
    const live = ticket as LiveTicket;
    if (live.exited) return;
    live.exited = true;
    this.#undelivered.delete(live);
    if (live.responseStarted) {
      const key = live.captureKey ?? '';
      const count = (this.#streaming.get(key) ?? 1) - 1;
      if (count === 0) this.#streaming.delete(key);
      else this.#streaming.set(key, count);
      this.#streamingCount -= 1;
    }
    this.admission.leave(live.admitted);
    this.onChange();
  }

  close(): void {
    this.admission.close();
  }

  open(): void {
    this.admission.open();
  }

  /**
   * Stops the calls of `episode` and its earlier attempts: the waiting ones leave refused, the
   * admitted ones are cancelled — each once, so a retried retire waits for a call an earlier
   * retire cancelled without cancelling it again. Resolves once all of them left the gate.
   * Untagged calls are never touched.
   */
  async retire(episode: EpisodeId): Promise<void> {
    await Promise.all([this.admission.refuseWaiting([episode]), this.admission.retire(episode)]);
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
    return this.admission.inFlight;
  }

  /** Admitted calls whose response has not started. */
  get held(): number {
    return this.admission.inFlight - this.#streamingCount;
  }

  /** The ids of admitted tagged calls whose response has not started (they have no ledger row). */
  undeliveredCallIds(): Set<string> {
    return new Set([...this.#undelivered].map((t) => t.id));
  }

  /** How many tagged calls wait at closed admission (for tests and status). */
  get waitingCount(): number {
    return this.admission.waiting - this.admission.waitingUntagged;
  }
}
