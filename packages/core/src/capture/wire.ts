/**
 * Generation-cut and token-lineage wire models (reference §2.3, §2.6, §2.8, §3.2): ajv schemas
 * compiled once, every model rejecting unknown fields, plus the cross-field rules a schema cannot
 * say. A violation is `CaptureValidationError` (422 `invalid_request`) with a stable `reason`.
 */
import { Ajv, type ErrorObject, type ValidateFunction } from 'ajv';

import { InvalidRequestError } from '../errors.js';
import { isCaptureKey } from '../identity.js';
import { STAGING_SCHEMA_VERSION, pythonJson } from './hashes.js';
import { createHash } from 'node:crypto';

/** A capture-wire refusal: `reason` names the rule (e.g. `cut_parent_tokens_mismatch`). */
export class CaptureValidationError extends InvalidRequestError {
  constructor(
    readonly reason: string,
    detail: string,
  ) {
    super(`${reason}: ${detail}`);
  }
}

export const GENERATION_CUT_ROUTE = '/ng-control/v1/generation-cut';

const ajv = new Ajv({ allErrors: false, strict: true, allowUnionTypes: true });
ajv.addFormat('capture-key', { type: 'string', validate: isCaptureKey });

const hex = { type: 'string', pattern: '^[0-9a-f]{64}$' } as const;
const nullableHex = { type: ['string', 'null'], pattern: '^[0-9a-f]{64}$' } as const;
const nonEmpty = { type: 'string', minLength: 1 } as const;
const count = { type: 'integer', minimum: 0, maximum: Number.MAX_SAFE_INTEGER } as const;
const finishReason = { enum: ['stop', 'length', null] } as const;
const stopReason = { type: ['string', 'integer', 'null'] } as const;
const uniqueKeys = { type: 'array', items: nonEmpty, uniqueItems: true } as const;

function object(properties: Record<string, object>, required: string[] = Object.keys(properties)) {
  return { type: 'object', additionalProperties: false, required, properties };
}

const prefixFields = {
  ticket_id: nonEmpty,
  rollout_id: { type: 'string', minLength: 1, pattern: '^[A-Za-z0-9][A-Za-z0-9._-]*$' },
  attempt: count,
  model_call_id: nonEmpty,
  admitted_at: { type: 'number' },
};

const PREFIX = object(prefixFields);
const INVENTORY = object({
  checkpoint_id: { type: 'string' },
  server_name: nonEmpty,
  active_prefixes: { type: 'array', items: PREFIX },
  inventory_digest: hex,
});
const ACK = object(
  {
    ...prefixFields,
    disposition: { enum: ['durable_prefix', 'durable_failure'] },
    cut_kind: { enum: ['active_prefix', 'terminal_completion', null] },
    frozen_buffer_id: { type: ['string', 'null'], minLength: 1 },
    staging_keys: uniqueKeys,
    prefix_token_count: { type: ['integer', 'null'], minimum: 0 },
    prefix_digest: nullableHex,
    effective_output_limit: { type: ['integer', 'null'], minimum: 1 },
    terminal_finish_reason: finishReason,
    terminal_stop_reason: stopReason,
  },
  [...Object.keys(prefixFields), 'disposition'],
);
const RECEIPT = object({
  checkpoint_id: { type: 'string' },
  cut_id: nonEmpty,
  inventory_digest: hex,
  inventory: INVENTORY,
  backend_snapshot_id: nonEmpty,
  prefixes: { type: 'array', items: ACK },
});
const CONTINUATION = object(
  {
    schema_version: { const: STAGING_SCHEMA_VERSION },
    source_capture_key: { type: 'string', format: 'capture-key' },
    source_model_call_id: nonEmpty,
    staging_keys: { ...uniqueKeys, minItems: 1 },
    prefix_token_count: count,
    prefix_digest: hex,
    effective_output_limit: { type: 'integer', minimum: 1 },
    terminal_finish_reason: finishReason,
    terminal_stop_reason: stopReason,
  },
  [
    'schema_version',
    'source_capture_key',
    'source_model_call_id',
    'staging_keys',
    'prefix_token_count',
    'prefix_digest',
    'effective_output_limit',
  ],
);
const ADMISSION = object({
  schema_version: { const: STAGING_SCHEMA_VERSION },
  rollout_id: { type: 'string', format: 'capture-key' },
  model_call_id: nonEmpty,
  parent_call_id: { type: ['string', 'null'], minLength: 1 },
  prev_len: count,
  mode: { enum: ['token_in', 'text'] },
  required_prefix_token_ids: { type: 'array', items: count },
  staging_chain: { type: ['array', 'null'], items: nonEmpty },
  parent_chain_hash: nullableHex,
  generation_cut: { anyOf: [{ type: 'null' }, CONTINUATION] },
});
const COORDS = object({
  schema_version: { const: STAGING_SCHEMA_VERSION },
  digest_version: { type: 'integer' },
  extras_digest_version: { type: 'integer' },
  rollout_id: { type: 'string', format: 'capture-key' },
  model_call_id: nonEmpty,
  parent_call_id: { type: ['string', 'null'] },
  prev_len: count,
  delta_len: count,
  cum_len: count,
  weight_version: count,
  disposition: { enum: ['staged', 'capture_failed'] },
  digest: nullableHex,
  extras_digest: nullableHex,
  staging_key: { type: ['string', 'null'], minLength: 1 },
  chain_hash: nullableHex,
  cumulative_hash: nullableHex,
});
const STAGED = object({
  schema_version: { const: STAGING_SCHEMA_VERSION },
  rollout_id: { type: 'string', format: 'capture-key' },
  model_call_id: nonEmpty,
  parent_call_id: { type: ['string', 'null'] },
  mode: { enum: ['token_in', 'text'] },
  prev_len: count,
  delta_len: count,
  cum_len: count,
  weight_version: count,
  token_ids_delta: { type: 'array', items: count },
  masks: { type: 'array', items: { enum: [0, 1] } },
  logprobs: { type: 'array', items: { type: 'number' } },
  extras: {},
  extras_digest: hex,
  chain_hash: hex,
  cumulative_hash: hex,
  digest: hex,
});

export type FinishReason = 'stop' | 'length' | null;

export interface GenerationCutPrefix {
  ticket_id: string;
  rollout_id: string;
  attempt: number;
  model_call_id: string;
  admitted_at: number;
}

export interface GenerationCutInventory {
  checkpoint_id: string;
  server_name: string;
  active_prefixes: GenerationCutPrefix[];
  inventory_digest: string;
}

export interface GenerationCutPrefixAck extends GenerationCutPrefix {
  disposition: 'durable_prefix' | 'durable_failure';
  cut_kind?: 'active_prefix' | 'terminal_completion' | null;
  frozen_buffer_id?: string | null;
  staging_keys?: string[];
  prefix_token_count?: number | null;
  prefix_digest?: string | null;
  effective_output_limit?: number | null;
  terminal_finish_reason?: FinishReason;
  terminal_stop_reason?: string | number | null;
}

export interface GenerationCutReceipt {
  checkpoint_id: string;
  cut_id: string;
  inventory_digest: string;
  inventory: GenerationCutInventory;
  backend_snapshot_id: string;
  prefixes: GenerationCutPrefixAck[];
}

export interface GenerationCutContinuation {
  schema_version: number;
  source_capture_key: string;
  source_model_call_id: string;
  staging_keys: string[];
  prefix_token_count: number;
  prefix_digest: string;
  effective_output_limit: number;
  terminal_finish_reason?: FinishReason;
  terminal_stop_reason?: string | number | null;
}

export interface CaptureAdmission {
  schema_version: number;
  /** The capture key of the calling attempt. */
  rollout_id: string;
  model_call_id: string;
  parent_call_id: string | null;
  prev_len: number;
  mode: 'token_in' | 'text';
  required_prefix_token_ids: number[];
  /** Staging keys of the parent's chain, root first: their deltas concatenate to the prefix. */
  staging_chain: string[] | null;
  parent_chain_hash: string | null;
  generation_cut: GenerationCutContinuation | null;
}

/**
 * The admission of a root call of capture key `key`: no parent, nothing before it, text mode, no
 * generation cut. The one place its fields are written out.
 */
export function rootCaptureAdmission(key: string, modelCallId: string): CaptureAdmission {
  return {
    schema_version: STAGING_SCHEMA_VERSION,
    rollout_id: key,
    model_call_id: modelCallId,
    parent_call_id: null,
    prev_len: 0,
    mode: 'text',
    required_prefix_token_ids: [],
    staging_chain: null,
    parent_chain_hash: null,
    generation_cut: null,
  };
}

export interface CommitCoords {
  schema_version: number;
  digest_version: number;
  extras_digest_version: number;
  rollout_id: string;
  model_call_id: string;
  parent_call_id: string | null;
  prev_len: number;
  delta_len: number;
  cum_len: number;
  weight_version: number;
  disposition: 'staged' | 'capture_failed';
  digest: string | null;
  extras_digest: string | null;
  staging_key: string | null;
  chain_hash: string | null;
  cumulative_hash: string | null;
}

/** One call's staged tokens in the worker's token store. */
export interface StagedCallRecord {
  schema_version: number;
  /** The capture key of the attempt that staged it. */
  rollout_id: string;
  model_call_id: string;
  parent_call_id: string | null;
  mode: 'token_in' | 'text';
  prev_len: number;
  delta_len: number;
  cum_len: number;
  weight_version: number;
  token_ids_delta: number[];
  masks: number[];
  logprobs: number[];
  extras: unknown;
  extras_digest: string;
  chain_hash: string;
  cumulative_hash: string;
  digest: string;
}

function compile<T>(schema: object): ValidateFunction<T> {
  return ajv.compile<T>(schema);
}

const validators = {
  inventory: compile<GenerationCutInventory>(INVENTORY),
  ack: compile<GenerationCutPrefixAck>(ACK),
  receipt: compile<GenerationCutReceipt>(RECEIPT),
  continuation: compile<GenerationCutContinuation>(CONTINUATION),
  admission: compile<CaptureAdmission>(ADMISSION),
  coords: compile<CommitCoords>(COORDS),
  staged: compile<StagedCallRecord>(STAGED),
};

function describe(errors: ErrorObject[] | null | undefined): string {
  const e = errors?.[0];
  if (!e) return 'invalid';
  const at = e.instancePath === '' ? '(root)' : e.instancePath;
  const extra =
    e.keyword === 'additionalProperties' ? ` (${String(e.params.additionalProperty)})` : '';
  return `${at} ${e.message ?? 'invalid'}${extra}`;
}

function check<T>(name: keyof typeof validators, value: unknown, what: string): T {
  const validate = validators[name] as ValidateFunction<T>;
  if (!validate(value)) {
    throw new CaptureValidationError(`invalid_${name}`, `${what}: ${describe(validate.errors)}`);
  }
  return value;
}

function rule(ok: boolean, reason: string, detail: string): void {
  if (!ok) throw new CaptureValidationError(reason, detail);
}

function checkTerminal(
  value: { terminal_finish_reason?: FinishReason; terminal_stop_reason?: unknown },
  what: string,
): void {
  rule(
    value.terminal_stop_reason === undefined ||
      value.terminal_stop_reason === null ||
      (value.terminal_finish_reason ?? null) !== null,
    `invalid_${what}`,
    'terminal_stop_reason requires terminal_finish_reason',
  );
}

const DURABLE_FIELDS = [
  'cut_kind',
  'frozen_buffer_id',
  'prefix_token_count',
  'prefix_digest',
  'effective_output_limit',
] as const;

export function parseAck(value: unknown): GenerationCutPrefixAck {
  const ack = check<GenerationCutPrefixAck>('ack', value, 'GenerationCutPrefixAck');
  const keys = ack.staging_keys ?? [];
  if (ack.disposition === 'durable_prefix') {
    for (const field of DURABLE_FIELDS) {
      rule((ack[field] ?? null) !== null, 'invalid_ack', `durable_prefix requires ${field}`);
    }
    rule(keys.length > 0, 'invalid_ack', 'durable_prefix requires staging_keys');
  } else {
    for (const field of DURABLE_FIELDS) {
      rule((ack[field] ?? null) === null, 'invalid_ack', `durable_failure carries no ${field}`);
    }
    rule(keys.length === 0, 'invalid_ack', 'durable_failure carries no staging_keys');
  }
  checkTerminal(ack, 'ack');
  return ack;
}

export function parseInventory(value: unknown): GenerationCutInventory {
  const inventory = check<GenerationCutInventory>('inventory', value, 'GenerationCutInventory');
  rule(
    inventoryDigest(inventory) === inventory.inventory_digest,
    'invalid_inventory',
    'inventory_digest does not match the inventory',
  );
  return inventory;
}

export function parseReceipt(value: unknown): GenerationCutReceipt {
  const receipt = check<GenerationCutReceipt>('receipt', value, 'GenerationCutReceipt');
  receipt.prefixes.forEach(parseAck);
  return receipt;
}

export function parseContinuation(value: unknown): GenerationCutContinuation {
  const c = check<GenerationCutContinuation>('continuation', value, 'GenerationCutContinuation');
  checkTerminal(c, 'continuation');
  return c;
}

export function parseCaptureAdmission(value: unknown): CaptureAdmission {
  const a = check<CaptureAdmission>('admission', value, 'CaptureAdmission');
  if (a.mode === 'token_in') {
    rule(
      a.parent_call_id !== null && a.prev_len > 0 && a.parent_chain_hash !== null,
      'invalid_admission',
      'token_in needs parent_call_id, prev_len > 0 and parent_chain_hash',
    );
    rule(
      a.staging_chain !== null || a.required_prefix_token_ids.length === a.prev_len,
      'invalid_admission',
      'token_in without a staging chain needs an inline prefix of prev_len tokens',
    );
  } else {
    rule(
      a.parent_call_id === null &&
        a.prev_len === 0 &&
        a.required_prefix_token_ids.length === 0 &&
        a.staging_chain === null &&
        a.parent_chain_hash === null,
      'invalid_admission',
      'a text admission is a parentless root',
    );
  }
  if (a.generation_cut !== null) parseContinuation(a.generation_cut);
  return a;
}

export function parseCommitCoords(value: unknown): CommitCoords {
  const c = check<CommitCoords>('coords', value, 'CommitCoords');
  rule(c.cum_len === c.prev_len + c.delta_len, 'invalid_coords', 'cum_len != prev_len + delta_len');
  rule(
    (c.parent_call_id === null) === (c.prev_len === 0),
    'invalid_coords',
    'parentless iff prev_len == 0',
  );
  const staged = [c.digest, c.extras_digest, c.staging_key, c.chain_hash, c.cumulative_hash];
  if (c.disposition === 'staged') {
    rule(
      staged.every((v) => v !== null) && c.delta_len > 0,
      'invalid_coords',
      'staged needs every digest and key, delta_len > 0',
    );
  } else {
    rule(
      staged.every((v) => v === null) && c.delta_len === 0,
      'invalid_coords',
      'capture_failed carries no digest, key or tokens',
    );
  }
  return c;
}

export function parseStagedRecord(value: unknown): StagedCallRecord {
  const r = check<StagedCallRecord>('staged', value, 'StagedCallRecord');
  rule(
    r.token_ids_delta.length === r.delta_len &&
      r.masks.length === r.delta_len &&
      r.logprobs.length === r.delta_len &&
      r.cum_len === r.prev_len + r.delta_len,
    'invalid_snapshot',
    'token, mask and logprob lengths must equal delta_len, cum_len = prev_len + delta_len',
  );
  return r;
}

/** The inventory digest: SHA-256 of Python's `json.dumps(sort_keys=True, separators=(",",":"))`. */
export function inventoryDigest(
  inventory: Omit<GenerationCutInventory, 'inventory_digest'>,
): string {
  const prefixes = [...inventory.active_prefixes].sort((a, b) =>
    a.ticket_id < b.ticket_id ? -1 : a.ticket_id > b.ticket_id ? 1 : 0,
  );
  const body = {
    checkpoint_id: inventory.checkpoint_id,
    server_name: inventory.server_name,
    active_prefixes: prefixes,
  };
  return createHash('sha256')
    .update(pythonJson(body, new Set(['admitted_at'])))
    .digest('hex');
}

export function buildInventory(
  checkpointId: string,
  serverName: string,
  prefixes: readonly GenerationCutPrefix[],
): GenerationCutInventory {
  const active = [...prefixes].sort((a, b) =>
    a.ticket_id < b.ticket_id ? -1 : a.ticket_id > b.ticket_id ? 1 : 0,
  );
  const base = { checkpoint_id: checkpointId, server_name: serverName, active_prefixes: active };
  return { ...base, inventory_digest: inventoryDigest(base) };
}

function samePrefix(a: GenerationCutPrefix, b: GenerationCutPrefix): boolean {
  return (
    a.ticket_id === b.ticket_id &&
    a.rollout_id === b.rollout_id &&
    a.attempt === b.attempt &&
    a.model_call_id === b.model_call_id &&
    a.admitted_at === b.admitted_at
  );
}

/**
 * Field by field (the schema admits no other fields): with thousands of calls in flight,
 * serialising both inventories to compare them cost more than the rest of the cut round.
 */
function sameInventory(echo: GenerationCutInventory, sent: GenerationCutInventory): boolean {
  return (
    echo.checkpoint_id === sent.checkpoint_id &&
    echo.server_name === sent.server_name &&
    echo.inventory_digest === sent.inventory_digest &&
    echo.active_prefixes.length === sent.active_prefixes.length &&
    echo.active_prefixes.every((prefix, i) => samePrefix(prefix, sent.active_prefixes[i]!))
  );
}

/**
 * Checks a receipt against the inventory sent: the echo and digests match, every ticket is acked
 * exactly once, and each ack names the inventory entry's call.
 */
export function validateReceiptFor(
  value: unknown,
  inventory: GenerationCutInventory,
): GenerationCutReceipt {
  const receipt = parseReceipt(value);
  rule(
    receipt.checkpoint_id === inventory.checkpoint_id &&
      receipt.inventory_digest === inventory.inventory_digest &&
      sameInventory(receipt.inventory, inventory),
    'receipt_mismatch',
    'the receipt does not echo the inventory sent',
  );
  const sent = new Map(inventory.active_prefixes.map((p) => [p.ticket_id, p]));
  const seen = new Set<string>();
  for (const ack of receipt.prefixes) {
    const entry = sent.get(ack.ticket_id);
    rule(entry !== undefined, 'receipt_mismatch', `ack for unknown ticket ${ack.ticket_id}`);
    rule(!seen.has(ack.ticket_id), 'receipt_mismatch', `ticket ${ack.ticket_id} acked twice`);
    seen.add(ack.ticket_id);
    rule(
      entry!.rollout_id === ack.rollout_id &&
        entry!.attempt === ack.attempt &&
        entry!.model_call_id === ack.model_call_id &&
        entry!.admitted_at === ack.admitted_at,
      'receipt_mismatch',
      `ack of ticket ${ack.ticket_id} names another call`,
    );
  }
  rule(seen.size === sent.size, 'receipt_mismatch', 'not every ticket was acked');
  return receipt;
}

/** `failure(prefix)`: the prefix's fields and `durable_failure`. */
export function failureAck(prefix: GenerationCutPrefix): GenerationCutPrefixAck {
  return { ...prefix, disposition: 'durable_failure' };
}
