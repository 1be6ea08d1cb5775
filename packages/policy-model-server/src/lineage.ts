/**
 * Token lineage on the model side (reference §3.5): a call's parent is resolved once, before
 * dispatch, from the request as received — by the assistant fingerprint of its messages and the
 * context digest of the ledger rows — and turned into the capture admission sent to the worker in
 * `ng_capture`. The worker's `ng_commit_coords` fill the custody columns of the call's row.
 */
import {
  type CaptureAdmission,
  type CommitCoords,
  FINGERPRINT_VERSION,
  assistantFingerprint,
  conversationDigest,
  parseCommitCoords,
  rootCaptureAdmission,
} from '@ckpt-gym/core/capture';
import { type JsonObject } from '@ckpt-gym/core/protocol';

export const UNRESOLVED_PARENT_REASON = 'unresolved_parent';
export const PARENT_WITHOUT_CHAIN_REASON = 'parent_missing_chain_hash';
export const WORKER_CAPTURE_FAILED = 'worker_capture_failed';
export const MISSING_COORDS = 'worker_response_missing_commit_coordinates';
export const INVALID_COORDS = 'invalid_worker_commit_coordinates';

export type Resolution =
  | { kind: 'root' }
  | { kind: 'resolved'; parent: JsonObject }
  | { kind: 'unresolved'; reason: string };

const isFailure = (row: JsonObject): boolean => row.failure_reason !== undefined;

/**
 * The parent of a call whose request carries `messages`, among `rows` of its capture key. No
 * assistant history is a root; an unresolved call with rows is a failure, never a root (its
 * earlier generated tokens would train as prompt); without any row it is a root.
 */
export function resolveParent(
  rows: readonly JsonObject[],
  messages: readonly unknown[],
): Resolution {
  const fingerprint = assistantFingerprint(messages);
  if (fingerprint === '') return { kind: 'root' };
  const custody = rows.filter((row) => !isFailure(row));
  const matches = new Map<string, JsonObject>();
  for (const row of custody) {
    if (row.output_fingerprint !== fingerprint || row.fingerprint_version !== FINGERPRINT_VERSION)
      continue;
    const len = row.context_len;
    if (typeof len !== 'number' || len > messages.length) continue;
    if (conversationDigest(messages.slice(0, len)) !== row.context_digest) continue;
    // Identical token sequences (a retried call) collapse to the smallest call id.
    const same = `${String(row.cumulative_hash)}:${String(row.cum_len)}`;
    const kept = matches.get(same);
    if (!kept || String(row.model_call_id) < String(kept.model_call_id)) matches.set(same, row);
  }
  if (matches.size === 1) {
    const parent = [...matches.values()][0]!;
    if (typeof parent.chain_hash !== 'string' || !Array.isArray(parent.staging_chain)) {
      return { kind: 'unresolved', reason: PARENT_WITHOUT_CHAIN_REASON };
    }
    return { kind: 'resolved', parent };
  }
  if (custody.length === 0) return { kind: 'root' };
  return { kind: 'unresolved', reason: UNRESOLVED_PARENT_REASON };
}

/** The capture admission of a resolved or root call (no generation cut yet). */
export function captureAdmission(
  key: string,
  callId: string,
  resolution: Exclude<Resolution, { kind: 'unresolved' }>,
): CaptureAdmission {
  const root = rootCaptureAdmission(key, callId);
  if (resolution.kind === 'root') return root;
  const { parent } = resolution;
  return {
    ...root,
    parent_call_id: String(parent.model_call_id),
    prev_len: Number(parent.cum_len),
    mode: 'token_in',
    staging_chain: (parent.staging_chain as string[]).slice(),
    parent_chain_hash: String(parent.chain_hash),
  };
}

/**
 * A call whose decoding compiles into a structured decoder is never cut and never continues a
 * cut (the decoder state cannot be restored from a token prefix); null when it may.
 */
export function cutRestartReason(request: Record<string, unknown>): string | null {
  const choice = request.tool_choice;
  if (typeof choice === 'string') {
    if (choice !== 'auto' && choice !== 'none') return `tool_choice:${choice}`;
  } else if (choice !== undefined && choice !== null) {
    return 'tool_choice:constrained';
  }
  const format = request.response_format;
  if (format !== undefined && format !== null) {
    const type = (format as { type?: unknown }).type;
    if (type !== 'text') return `response_format:${typeof type === 'string' ? type : 'unknown'}`;
  }
  for (const field of [
    'guided_choice',
    'guided_grammar',
    'guided_json',
    'guided_regex',
    'guided_whitespace_pattern',
    'structural_tag',
    'structured_outputs',
  ]) {
    if (request[field] !== undefined && request[field] !== null) return field;
  }
  return null;
}

/** What the proxy knows of a call's lineage at dispatch. */
export interface CallLineage {
  /** The admission sent to the worker, or null for an unresolved call (a failure row). */
  admission: CaptureAdmission | null;
  failureReason: string | null;
  messages: readonly unknown[];
}

/** The lineage columns of a delivered call's row, from the worker's coordinates. */
export function lineageColumns(
  lineage: CallLineage,
  coordsValue: unknown,
  answerMessage: unknown,
): { columns: JsonObject; failureReason: string | null } {
  if (lineage.admission === null) {
    return { columns: {}, failureReason: lineage.failureReason ?? UNRESOLVED_PARENT_REASON };
  }
  if (coordsValue === undefined) return { columns: {}, failureReason: MISSING_COORDS };
  let coords: CommitCoords;
  try {
    coords = parseCommitCoords(coordsValue);
  } catch {
    return { columns: {}, failureReason: INVALID_COORDS };
  }
  const { admission } = lineage;
  if (
    coords.rollout_id !== admission.rollout_id ||
    coords.model_call_id !== admission.model_call_id ||
    (coords.disposition === 'staged' &&
      (coords.parent_call_id !== admission.parent_call_id ||
        coords.prev_len !== admission.prev_len))
  ) {
    return { columns: {}, failureReason: INVALID_COORDS };
  }
  if (coords.disposition === 'capture_failed')
    return { columns: {}, failureReason: WORKER_CAPTURE_FAILED };
  const columns: JsonObject = {
    parent_call_id: coords.parent_call_id,
    prev_len: coords.prev_len,
    delta_len: coords.delta_len,
    cum_len: coords.cum_len,
    weight_version: coords.weight_version,
    digest: coords.digest,
    extras_digest: coords.extras_digest,
    staging_key: coords.staging_key,
    mode: admission.mode,
    chain_hash: coords.chain_hash,
    cumulative_hash: coords.cumulative_hash,
    staging_chain: [...(admission.staging_chain ?? []), coords.staging_key!],
  };
  // A streamed answer is not known when its row is published (at its first chunk): its row
  // carries no fingerprint and is never a parent.
  if (answerMessage !== undefined) {
    const context = [...lineage.messages, answerMessage];
    columns.output_fingerprint = assistantFingerprint(context);
    columns.context_len = context.length;
    columns.context_digest = conversationDigest(context);
    columns.fingerprint_version = FINGERPRINT_VERSION;
  }
  return { columns, failureReason: null };
}
