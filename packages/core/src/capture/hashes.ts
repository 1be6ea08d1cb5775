/**
 * Token-lineage hashes (reference §3.4, staging schema 2): SHA-256 with fixed domain prefixes and
 * fixed-width encodings, so a worker in any language stages digests the gym can check. Integers
 * are unsigned 64-bit big-endian; token id lists are length + ids; texts are length-prefixed UTF-8.
 */
import { createHash, type Hash } from 'node:crypto';

export const STAGING_SCHEMA_VERSION = 2;
export const STAGING_DIGEST_VERSION = 2;
export const EXTRAS_DIGEST_VERSION = 1;

export const PREFIX_DOMAIN = 'nemo-gym-staging-prefix-v2';
export const CHAIN_DOMAIN = 'nemo-gym-staging-chain-v1';
export const CALL_DOMAIN = 'nemo-gym-staging-call-v2';
export const EXTRAS_DOMAIN = 'nemo-gym-staging-extras-v1';

export const HEX_DIGEST = /^[0-9a-f]{64}$/;

function u64(value: number): Buffer {
  if (!Number.isSafeInteger(value) || value < 0) {
    throw new RangeError(`not an unsigned 64-bit integer: ${value}`);
  }
  const buf = Buffer.alloc(8);
  buf.writeBigUInt64BE(BigInt(value));
  return buf;
}

function i64(value: number): Buffer {
  const buf = Buffer.alloc(8);
  buf.writeBigInt64BE(BigInt(value));
  return buf;
}

function f64(value: number): Buffer {
  const buf = Buffer.alloc(8);
  buf.writeDoubleBE(value);
  return buf;
}

function updateText(hash: Hash, text: string): void {
  const bytes = Buffer.from(text, 'utf8');
  hash.update(u64(bytes.length));
  hash.update(bytes);
}

function updateTokenIds(hash: Hash, ids: readonly number[]): void {
  hash.update(u64(ids.length));
  const buf = Buffer.alloc(8 * ids.length);
  ids.forEach((id, i) => {
    if (!Number.isSafeInteger(id) || id < 0) throw new RangeError(`invalid token id: ${id}`);
    buf.writeBigUInt64BE(BigInt(id), 8 * i);
  });
  hash.update(buf);
}

function updateFloat32s(hash: Hash, values: readonly number[]): void {
  hash.update(u64(values.length));
  const buf = Buffer.alloc(4 * values.length);
  values.forEach((v, i) => buf.writeFloatBE(v, 4 * i));
  hash.update(buf);
}

/** The cumulative hash of a token sequence. */
export function hashTokenIds(ids: readonly number[]): string {
  const hash = createHash('sha256').update(PREFIX_DOMAIN);
  updateTokenIds(hash, ids);
  return hash.digest('hex');
}

/** The chain hash of a call: its parent's chain hash (null for a root) extended by its delta. */
export function computeChainHash(parent: string | null, delta: readonly number[]): string {
  const hash = createHash('sha256').update(CHAIN_DOMAIN);
  if (parent === null) hash.update(Buffer.of(0));
  else hash.update(Buffer.concat([Buffer.of(1), Buffer.from(parent, 'hex')]));
  updateTokenIds(hash, delta);
  return hash.digest('hex');
}

function updateExtras(hash: Hash, value: unknown): void {
  if (value === null || value === undefined) {
    hash.update('N');
  } else if (typeof value === 'boolean') {
    hash.update('B').update(Buffer.of(value ? 1 : 0));
  } else if (typeof value === 'number') {
    if (Number.isSafeInteger(value)) hash.update('I').update(i64(value));
    else hash.update('F').update(f64(value));
  } else if (typeof value === 'string') {
    hash.update('S');
    updateText(hash, value);
  } else if (Array.isArray(value)) {
    hash.update('L').update(u64(value.length));
    for (const item of value) updateExtras(hash, item);
  } else if (typeof value === 'object') {
    // Keys sorted by their UTF-8 bytes, as the reference does.
    const entries = Object.entries(value as Record<string, unknown>).sort(([a], [b]) =>
      Buffer.compare(Buffer.from(a, 'utf8'), Buffer.from(b, 'utf8')),
    );
    hash.update('D').update(u64(entries.length));
    for (const [key, item] of entries) {
      updateText(hash, key);
      updateExtras(hash, item);
    }
  } else {
    throw new TypeError(`extras cannot hold a ${typeof value}`);
  }
}

/** The digest of a call's extras (any JSON value; null when the worker stages none). */
export function extrasDigest(extras: unknown): string {
  const hash = createHash('sha256').update(EXTRAS_DOMAIN).update(Buffer.of(EXTRAS_DIGEST_VERSION));
  updateExtras(hash, extras);
  return hash.digest('hex');
}

/** What the staging digest authenticates: every field of a staged record but the digest. */
export interface StagingDigestFields {
  readonly rollout_id: string;
  readonly model_call_id: string;
  readonly parent_call_id: string | null;
  readonly mode: string;
  readonly prev_len: number;
  readonly delta_len: number;
  readonly cum_len: number;
  readonly weight_version: number;
  readonly token_ids_delta: readonly number[];
  readonly masks: readonly number[];
  readonly logprobs: readonly number[];
  readonly extras_digest: string;
  readonly chain_hash: string;
  readonly cumulative_hash: string;
}

export type StagingDigestFn = (fields: StagingDigestFields) => string;

/** The staging digest of a record (reference §3.4). */
export const stagingDigest: StagingDigestFn = (f) => {
  const hash = createHash('sha256')
    .update(CALL_DOMAIN)
    .update(Buffer.of(STAGING_SCHEMA_VERSION, STAGING_DIGEST_VERSION, EXTRAS_DIGEST_VERSION));
  updateText(hash, f.rollout_id);
  updateText(hash, f.model_call_id);
  if (f.parent_call_id === null) hash.update(Buffer.of(0));
  else {
    hash.update(Buffer.of(1));
    updateText(hash, f.parent_call_id);
  }
  updateText(hash, f.mode);
  for (const n of [f.prev_len, f.delta_len, f.cum_len, f.weight_version]) hash.update(u64(n));
  updateTokenIds(hash, f.token_ids_delta);
  updateFloat32s(hash, f.masks);
  updateFloat32s(hash, f.logprobs);
  hash.update(Buffer.from(f.extras_digest, 'hex'));
  hash.update(Buffer.concat([Buffer.of(1), Buffer.from(f.chain_hash, 'hex')]));
  hash.update(Buffer.concat([Buffer.of(1), Buffer.from(f.cumulative_hash, 'hex')]));
  return hash.digest('hex');
};

// --- conversation digests (parent resolution, restored-cut matching) -------------------------

/** A chat message as lineage sees it: role, text, tool calls (name and arguments), tool call id. */
export interface NormalizedMessage {
  role: string;
  content: string;
  tool_calls: { name: string; arguments: string }[];
  tool_call_id: string | null;
}

function contentText(content: unknown): string {
  if (typeof content === 'string') return content;
  if (!Array.isArray(content)) return '';
  return content
    .map((part) => {
      const text = (part as { text?: unknown } | null)?.text;
      return typeof text === 'string' ? text : '';
    })
    .join('');
}

/**
 * A tool call's arguments as text: a string as sent, none (missing or null) as '' (as NeMo Gym's
 * lineage canonicalizes them: `JSON.stringify` would give `undefined` for a missing one, which no
 * digest can hash), any other value as its JSON.
 */
function argumentsText(args: unknown): string {
  if (typeof args === 'string') return args;
  return args === undefined || args === null ? '' : JSON.stringify(args);
}

/**
 * Normalizes a chat message so the assistant turn a backend produced and the same turn a harness
 * sends back (content `null` vs missing, extra keys, reasoning) compare equal.
 */
export function normalizeMessage(message: unknown): NormalizedMessage {
  const m = (message ?? {}) as Record<string, unknown>;
  const calls = Array.isArray(m.tool_calls) ? m.tool_calls : [];
  return {
    role: typeof m.role === 'string' ? m.role : '',
    content: contentText(m.content),
    tool_calls: calls.map((call) => {
      const fn = ((call ?? {}) as { function?: Record<string, unknown> }).function ?? {};
      return {
        name: typeof fn.name === 'string' ? fn.name : '',
        arguments: argumentsText(fn.arguments),
      };
    }),
    tool_call_id: typeof m.tool_call_id === 'string' ? m.tool_call_id : null,
  };
}

function digestMessages(domain: string, messages: readonly NormalizedMessage[]): string {
  const hash = createHash('sha256').update(domain).update(u64(messages.length));
  for (const m of messages) {
    updateText(hash, m.role);
    updateText(hash, m.content);
    hash.update(u64(m.tool_calls.length));
    for (const call of m.tool_calls) {
      updateText(hash, call.name);
      updateText(hash, call.arguments);
    }
    if (m.tool_call_id === null) hash.update(Buffer.of(0));
    else {
      hash.update(Buffer.of(1));
      updateText(hash, m.tool_call_id);
    }
  }
  return hash.digest('hex');
}

/** Digest of a whole conversation (the context check of parent resolution, restored-cut key). */
export function conversationDigest(messages: readonly unknown[]): string {
  return digestMessages('ckpt-gym-conversation-v1', messages.map(normalizeMessage));
}

/**
 * Fingerprint of the model-authored turns of a conversation; '' when it has none (the call is a
 * root). A call's row stores the fingerprint of its request plus its own answer, so the next turn's
 * request, which carries that answer, finds it.
 */
export function assistantFingerprint(messages: readonly unknown[]): string {
  const turns = messages.map(normalizeMessage).filter((m) => m.role === 'assistant');
  return turns.length === 0 ? '' : digestMessages('ckpt-gym-assistant-fingerprint-v1', turns);
}

export const FINGERPRINT_VERSION = 1;

// --- Python-compatible JSON for the inventory digest -----------------------------------------

const NON_ASCII = /[\u007f-\uffff]/;

function pyString(text: string): string {
  // json.dumps(ensure_ascii=True): every non-ASCII code unit as \uXXXX.
  const json = JSON.stringify(text);
  if (!NON_ASCII.test(json)) return json;
  return json.replace(
    /[\u007f-\uffff]/g,
    (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`,
  );
}

/** A Python float's repr for a finite number (an integral float prints as `1.0`). */
export function pyFloat(value: number): string {
  if (!Number.isFinite(value)) throw new RangeError(`not a finite float: ${value}`);
  if (Number.isInteger(value) && Math.abs(value) < 1e16) return `${value}.0`;
  // JS prints 1e-7 where Python prints 1e-07; everything else matches (both are shortest repr).
  return String(value).replace(/e-(\d)$/, 'e-0$1');
}

/**
 * `json.dumps(value, sort_keys=True, separators=(",", ":"))`: keys sorted, ASCII escapes; numbers
 * at paths listed in `floats` (by key name) print as Python floats.
 */
export function pythonJson(value: unknown, floats: ReadonlySet<string>, key = ''): string {
  if (value === null) return 'null';
  if (typeof value === 'boolean') return value ? 'true' : 'false';
  if (typeof value === 'number') return floats.has(key) ? pyFloat(value) : String(value);
  if (typeof value === 'string') return pyString(value);
  // Loops and concatenation: inventories of thousands of calls are digested at every prepare.
  if (Array.isArray(value)) {
    let out = '[';
    for (let i = 0; i < value.length; i++) {
      if (i > 0) out += ',';
      out += pythonJson(value[i], floats, key);
    }
    return `${out}]`;
  }
  const object = value as Record<string, unknown>;
  // The default sort orders by UTF-16 code units, as `<` does.
  const keys = Object.keys(object).sort();
  let out = '{';
  for (let i = 0; i < keys.length; i++) {
    const k = keys[i]!;
    if (i > 0) out += ',';
    out += `${pyString(k)}:${pythonJson(object[k], floats, k)}`;
  }
  return `${out}}`;
}
