/**
 * The fake's worker side of token capture, through core's staging helpers: a call with an
 * `ng_capture` admission is opened with `beginCall` (continuing a generation-cut prefix when the
 * admission carries one), generates token by token, can be cut while in flight, and is staged by
 * `completeCall` under `<capture key>/<model call id>`. The token store lives in this process.
 */
import { randomUUID } from 'node:crypto';

import {
  type CommitCoords,
  type GenerationCutInventory,
  type GenerationCutPrefixAck,
  type GenerationCutReceipt,
  type LiveCall,
  type StagedCallRecord,
  CaptureValidationError,
  EXTRAS_DIGEST_VERSION,
  STAGING_DIGEST_VERSION,
  STAGING_SCHEMA_VERSION,
  beginCall,
  buildPrefixRecord,
  completeCall,
  continuedPrompt,
  failureAck,
  parseInventory,
} from '@ckpt-gym/core/capture';
import { isCaptureKey } from '@ckpt-gym/core/protocol';

import { promptTokens, type TokenStore } from './calls.js';
import type { ChatMessage } from './script.js';

/** The fake's policy version (fixed, as the reference fake's). */
export const WEIGHT_VERSION = 7;
/** Every generated token's logprob. */
export const TOKEN_LOGPROB = -0.1;
export const CUT_KEY_PREFIX = '__generation_cut__';
export const EFFECTIVE_OUTPUT_LIMIT = 1024;

/** A call being generated with capture on. */
export interface CapturedCall {
  readonly live: LiveCall;
  /** The tokens it decodes from (for a continued call: prefix plus the cut delta). */
  readonly prompt: readonly number[];
  /** Its tokens still to generate (a continued call skips what the cut holds). */
  readonly remaining: readonly number[];
  readonly generated: number[];
  readonly logprobs: number[];
  /** Generated tokens reused from a cut. */
  readonly reused: number;
}

/** The prompt tail a child call adds to its parent's tokens: messages after the last answer. */
function newMessages(messages: readonly ChatMessage[]): readonly ChatMessage[] {
  let last = -1;
  messages.forEach((m, i) => {
    if (m.role === 'assistant') last = i;
  });
  return messages.slice(last + 1);
}

function chainTokens(store: TokenStore, chain: readonly string[]): number[] {
  return chain.flatMap((key) => {
    const record = store.stagedRecord(key);
    if (!record)
      throw new CaptureValidationError('missing_parent_tokens', `nothing staged under ${key}`);
    return record.token_ids_delta;
  });
}

/**
 * Opens capture for a call: validates the admission (and a cut) through `beginCall`. `answer` is
 * the call's full answer tokens. Throws `CaptureValidationError` when the call cannot be staged.
 */
export function openCapture(
  store: TokenStore,
  admission: unknown,
  messages: readonly ChatMessage[],
  answer: readonly number[],
): CapturedCall {
  const raw = (admission ?? {}) as {
    staging_chain?: unknown;
    mode?: unknown;
    generation_cut?: unknown;
  };
  const chain = Array.isArray(raw.staging_chain) ? (raw.staging_chain as string[]) : null;
  const prefix = raw.mode === 'token_in' && chain ? chainTokens(store, chain) : undefined;
  const cut = (raw.generation_cut ?? null) as { staging_keys?: unknown } | null;
  const cutKeys = Array.isArray(cut?.staging_keys) ? (cut.staging_keys as string[]) : [];
  const snapshot = cutKeys.length === 1 ? store.stagedRecord(cutKeys[0]!) : undefined;
  if (cut !== null && snapshot === undefined) {
    throw new CaptureValidationError(
      'cut_snapshot_missing',
      `no staged cut under ${cutKeys.join(', ')}`,
    );
  }
  const live = beginCall(admission, {
    weightVersion: WEIGHT_VERSION,
    ...(prefix ? { prefixTokenIds: prefix } : {}),
    ...(snapshot ? { generationCut: snapshot, generationCutStagingKeys: cutKeys } : {}),
  });
  const tail = promptTokens(live.admission.mode === 'text' ? messages : newMessages(messages));
  const reused = live.cut?.continuation.prefix_token_count ?? 0;
  return {
    live,
    prompt: live.cut ? continuedPrompt(live) : [...live.prefixTokenIds, ...tail],
    remaining: answer.slice(reused),
    generated: [],
    logprobs: [],
    reused,
  };
}

/** Generates the next `n` tokens of the call (at most what remains). */
export function generate(call: CapturedCall, n: number): void {
  const next = call.remaining.slice(call.generated.length, call.generated.length + n);
  for (const token of next) {
    call.generated.push(token);
    call.logprobs.push(TOKEN_LOGPROB);
  }
}

export function generateRest(call: CapturedCall): void {
  generate(call, call.remaining.length - call.generated.length);
}

/** Completes and stages the call; returns its commit coordinates. */
export function finishCapture(store: TokenStore, call: CapturedCall): CommitCoords {
  const { record, coords } = completeCall(call.live, call.prompt, call.generated, call.logprobs);
  store.stageCompleted(coords.staging_key!, record);
  return coords;
}

/** The coordinates of a call whose tokens were not staged, when the admission names the call. */
export function captureFailedCoords(
  admission: unknown,
  fallbackKey: string | undefined,
): CommitCoords | undefined {
  const a = (admission ?? {}) as { rollout_id?: unknown; model_call_id?: unknown };
  const key =
    typeof a.rollout_id === 'string' && isCaptureKey(a.rollout_id) ? a.rollout_id : fallbackKey;
  if (key === undefined || typeof a.model_call_id !== 'string' || a.model_call_id === '')
    return undefined;
  return {
    schema_version: STAGING_SCHEMA_VERSION,
    digest_version: STAGING_DIGEST_VERSION,
    extras_digest_version: EXTRAS_DIGEST_VERSION,
    rollout_id: key,
    model_call_id: a.model_call_id,
    parent_call_id: null,
    prev_len: 0,
    delta_len: 0,
    cum_len: 0,
    weight_version: WEIGHT_VERSION,
    disposition: 'capture_failed',
    digest: null,
    extras_digest: null,
    staging_key: null,
    chain_hash: null,
    cumulative_hash: null,
  };
}

/**
 * Serves one generation-cut inventory: each call still in flight with at least one generated
 * token is snapshotted (`buildPrefixRecord`, the call keeps going) and staged under
 * `__generation_cut__/<capture key>/<model call id>/<round>`; a call this worker already finished
 * (its answer held by the gym) is a `terminal_completion` cut of its staged record; a call it does
 * not know, or one that generated nothing yet (regenerating it costs nothing), is a
 * `durable_failure`.
 */
export function cutRound(
  store: TokenStore,
  active: ReadonlyMap<string, CapturedCall>,
  body: unknown,
): GenerationCutReceipt {
  const inventory: GenerationCutInventory = parseInventory(body);
  const round = store.cutRounds().length;
  const cut: string[] = [];
  const prefixes = inventory.active_prefixes.map((prefix): GenerationCutPrefixAck => {
    const call = active.get(prefix.model_call_id);
    const finishedKey = store.completedKey(prefix.model_call_id);
    let key: string;
    let record: StagedCallRecord;
    let terminal = false;
    if (call && call.generated.length > 0) {
      record = buildPrefixRecord(call.live, call.prompt, call.generated, call.logprobs);
      key = `${CUT_KEY_PREFIX}/${record.rollout_id}/${record.model_call_id}/${round}`;
      store.stage(key, record);
    } else if (!call && finishedKey !== undefined) {
      key = finishedKey;
      record = store.stagedRecord(finishedKey)!;
      terminal = true;
    } else {
      return failureAck(prefix);
    }
    cut.push(prefix.model_call_id);
    return {
      ...prefix,
      disposition: 'durable_prefix',
      cut_kind: terminal ? 'terminal_completion' : 'active_prefix',
      frozen_buffer_id: randomUUID(),
      staging_keys: [key],
      prefix_token_count: record.masks.filter((m) => m === 1).length,
      prefix_digest: record.digest,
      effective_output_limit: EFFECTIVE_OUTPUT_LIMIT,
      terminal_finish_reason: terminal ? 'stop' : null,
      terminal_stop_reason: null,
    };
  });
  store.recordCutRound(cut);
  return {
    checkpoint_id: inventory.checkpoint_id,
    cut_id: randomUUID(),
    inventory_digest: inventory.inventory_digest,
    inventory,
    backend_snapshot_id: 'fake-token-store',
    prefixes,
  };
}
