/**
 * Generation cuts (reference §2): at prepare one inventory of the undelivered captured calls is
 * sent to the worker's cut route over the control pool, with half of the prepare time remaining;
 * the receipt is validated against the inventory and each `durable_prefix` ack becomes a cut
 * record. A failed or hung cut only costs regeneration. Per capture key the latest cut is kept
 * (`#cuts`): the commit exports it, a restore installs it for the replacement attempt, and the
 * re-issued call with the same request digest continues it through its admission.
 */
import {
  GENERATION_CUT_ROUTE,
  type GenerationCutContinuation,
  type GenerationCutPrefix,
  type GenerationCutPrefixAck,
  STAGING_SCHEMA_VERSION,
  buildInventory,
  failureAck,
  parseContinuation,
  validateReceiptFor,
} from '@ckpt-gym/core/capture';
import { covers, type EpisodeId, type JsonObject, parseCaptureKey } from '@ckpt-gym/core/protocol';
import { type Logger } from '@ckpt-gym/core/server';
import type { Got } from 'got';

import type { Ticket } from './gate.js';

/** What the cut round needs of an undelivered call. */
export interface CuttableCall {
  readonly ticket: Ticket;
  /** Conversation digest of the request: a restored cut continues only the same request. */
  readonly requestDigest: string;
  /** Set for constrained decoding: never cut, never continues a cut. */
  readonly restartReason: string | null;
  /** The call was sent with a capture admission (the worker can snapshot it). */
  readonly captured: boolean;
}

export interface CutRecord {
  capture_key: string;
  model_call_id: string;
  request_digest: string;
  admitted_at: number;
  cut_id: string;
  continuation: GenerationCutContinuation;
}

/** A kept cut and the capture key it is kept under (a restored one: its replacement attempt). */
export interface KeptCut {
  readonly key: string;
  readonly record: CutRecord;
}

interface CutEntry {
  record: CutRecord;
  /** The live call continuing (or owning) it; freed when that call leaves undelivered. */
  usedBy: string | null;
  /**
   * The call that claimed it from the coordinator of several workers (a restored cut has one
   * owner): a call that used it never gives it back, so a retry regenerates.
   */
  claimedBy?: string;
}

/** The cut route of a backend: its OpenAI base URL without a trailing `/` and `/v1`. */
export function generationCutUrl(backendUrl: string): string {
  const root = backendUrl.replace(/\/+$/, '').replace(/\/v1$/, '');
  return `${root}${GENERATION_CUT_ROUTE}`;
}

export interface CutOptions {
  serverName: string;
  url: string;
  token: string;
  control: Got;
  logger: Logger;
}

/** Parses a cut record from a checkpoint (its continuation is the staging wire model). */
export function parseCutRecord(value: JsonObject): CutRecord {
  const {
    capture_key: key,
    model_call_id: id,
    request_digest: digest,
    admitted_at: at,
    cut_id: cut,
  } = value;
  if (
    typeof key !== 'string' ||
    typeof id !== 'string' ||
    typeof digest !== 'string' ||
    typeof at !== 'number' ||
    typeof cut !== 'string'
  ) {
    throw new TypeError(
      'a cut record needs capture_key, model_call_id, request_digest, admitted_at and cut_id',
    );
  }
  parseCaptureKey(key);
  return {
    capture_key: key,
    model_call_id: id,
    request_digest: digest,
    admitted_at: at,
    cut_id: cut,
    continuation: parseContinuation(value.continuation),
  };
}

export class GenerationCuts {
  readonly #calls = new Map<string, CuttableCall>();
  /** The latest cut per capture key. */
  readonly #cuts = new Map<string, CutEntry>();
  /** The checkpoint whose cut round ran since admission closed (one round per close). */
  #roundFor: string | null = null;
  failures = 0;
  skipped = 0;

  constructor(private readonly options: CutOptions) {}

  /**
   * Registers a dispatched call; returns the continuation it carries when a kept cut of its
   * capture key matches its request (the call then uses the cut until it delivers or leaves).
   */
  register(call: CuttableCall): GenerationCutContinuation | null {
    this.#calls.set(call.ticket.id, call);
    const key = call.ticket.captureKey;
    if (key === undefined || call.restartReason !== null || !call.captured) return null;
    const entry = this.#cuts.get(key);
    if (!entry || entry.record.request_digest !== call.requestDigest) return null;
    if (entry.usedBy !== null && this.#calls.has(entry.usedBy)) return null;
    entry.usedBy = call.ticket.id;
    return entry.record.continuation;
  }

  /** The call's response started: a cut it used is spent. */
  delivered(ticket: Ticket): void {
    const key = ticket.captureKey;
    const entry = key === undefined ? undefined : this.#cuts.get(key);
    if (entry?.usedBy === ticket.id) this.#cuts.delete(key!);
  }

  /**
   * The call left: a cut it used and did not deliver stays for its retry, unless it was claimed
   * from the coordinator (spent). Returns the claimed cut nothing used, for the coordinator.
   */
  left(ticket: Ticket): CutRecord | undefined {
    this.#calls.delete(ticket.id);
    const key = ticket.captureKey;
    const entry = key === undefined ? undefined : this.#cuts.get(key);
    if (entry === undefined) return undefined;
    if (entry.claimedBy !== undefined && entry.usedBy === ticket.id) {
      this.#cuts.delete(key!);
      return undefined;
    }
    if (entry.usedBy === ticket.id) entry.usedBy = null;
    if (entry.claimedBy === ticket.id && entry.usedBy === null) {
      this.#cuts.delete(key!);
      return entry.record;
    }
    return undefined;
  }

  /**
   * A restored cut the coordinator handed this worker's call before it registers; false (the
   * caller gives it back) when the worker already keeps a cut of that capture key.
   */
  claimed(ticket: Ticket, record: CutRecord): boolean {
    const key = ticket.captureKey;
    if (key === undefined || this.#cuts.has(key)) return false;
    this.#cuts.set(key, { record, usedBy: null, claimedBy: ticket.id });
    return true;
  }

  /** The kept cuts by capture key (a worker's snapshot: its coordinator exports them). */
  keptCuts(): KeptCut[] {
    return [...this.#cuts].map(([key, entry]) => ({ key, record: entry.record }));
  }

  reopened(): void {
    this.#roundFor = null;
  }

  /**
   * One cut round per close: every captured undelivered call without a restart reason is sent in
   * one inventory; the newest cut of each capture key replaces the kept one and is claimed by its
   * call. Never throws: a failure only costs regeneration.
   */
  async cutRound(checkpointId: string, deadlineTs: number): Promise<void> {
    if (this.#roundFor === checkpointId) return;
    this.#roundFor = checkpointId;
    const eligible: CuttableCall[] = [];
    for (const call of this.#calls.values()) {
      if (call.ticket.captureKey === undefined || call.ticket.responseStarted || !call.captured)
        continue;
      if (call.restartReason !== null) this.skipped += 1;
      else eligible.push(call);
    }
    if (eligible.length === 0) return;
    const byTicket = new Map(eligible.map((c) => [c.ticket.id, c]));
    const prefixes: GenerationCutPrefix[] = eligible.map(({ ticket }) => ({
      ticket_id: ticket.id,
      rollout_id: ticket.episode!.rollout_id,
      attempt: ticket.episode!.attempt,
      model_call_id: ticket.id,
      admitted_at: ticket.admittedAt,
    }));
    const inventory = buildInventory(checkpointId, this.options.serverName, prefixes);
    let acks: GenerationCutPrefixAck[];
    let cutId = '';
    // Half of the time left: the stages after the model need time too.
    const timeoutMs = Math.max(1, Math.floor((deadlineTs * 1000 - Date.now()) / 2));
    try {
      const body = await this.options.control
        .post(this.options.url, {
          json: inventory,
          headers: { authorization: `Bearer ${this.options.token}` },
          timeout: { request: timeoutMs },
          retry: { limit: 0 },
        })
        .json();
      const receipt = validateReceiptFor(body, inventory);
      acks = receipt.prefixes;
      cutId = receipt.cut_id;
    } catch (err) {
      this.options.logger.warn('generation cut failed; the calls regenerate after a restore', {
        checkpoint_id: checkpointId,
        url: this.options.url,
        calls: prefixes.length,
        error: (err as Error).message,
      });
      acks = prefixes.map(failureAck);
    }
    const newest = new Map<string, { call: CuttableCall; record: CutRecord }>();
    for (const ack of acks) {
      const call = byTicket.get(ack.ticket_id);
      if (!call || ack.disposition !== 'durable_prefix') {
        this.failures += 1;
        continue;
      }
      const key = call.ticket.captureKey!;
      const record: CutRecord = {
        capture_key: key,
        model_call_id: ack.model_call_id,
        request_digest: call.requestDigest,
        admitted_at: call.ticket.admittedAt,
        cut_id: cutId,
        continuation: {
          schema_version: STAGING_SCHEMA_VERSION,
          source_capture_key: key,
          source_model_call_id: ack.model_call_id,
          staging_keys: ack.staging_keys ?? [],
          prefix_token_count: ack.prefix_token_count!,
          prefix_digest: ack.prefix_digest!,
          effective_output_limit: ack.effective_output_limit!,
          terminal_finish_reason: ack.terminal_finish_reason ?? null,
          terminal_stop_reason: ack.terminal_stop_reason ?? null,
        },
      };
      const seen = newest.get(key);
      if (!seen || seen.call.ticket.admittedAt <= call.ticket.admittedAt)
        newest.set(key, { call, record });
    }
    for (const [key, { call, record }] of newest) {
      this.#cuts.set(key, { record, usedBy: call.ticket.id });
    }
  }

  /** The cut the commit exports for a capture key (at most one per episode). */
  exportCut(key: string): CutRecord | undefined {
    return this.#cuts.get(key)?.record;
  }

  /** Installs a restored cut for the attempt that continues its episode. */
  install(target: string, record: CutRecord): void {
    this.#cuts.set(target, { record, usedBy: null });
  }

  drop(key: string): void {
    this.#cuts.delete(key);
  }

  /** Drops the cuts of `episode` and its earlier attempts. */
  retire(episode: EpisodeId): void {
    for (const key of [...this.#cuts.keys()]) {
      if (covers(episode, parseCaptureKey(key))) this.#cuts.delete(key);
    }
  }

  get keptCount(): number {
    return this.#cuts.size;
  }
}
