/**
 * Rebuild (reference §3.7): from a rollout's ledger manifest and the staged records, verify every
 * row against its staged record and linearize the terminal call's token sequence — parent chain
 * root first, each chain hash recomputed, the terminal cumulative hash checked. Rows a restore
 * carried over name the attempt that staged them (`capture_key`); a stamp naming the same rollout
 * at the same or an earlier attempt is accepted, anything else is `foreign_capture_key`.
 */
import { captureKey, parseCaptureKey } from '../identity.js';
import { computeChainHash, hashTokenIds } from './hashes.js';
import { verifyStagedRecord } from './staging.js';
import { CaptureValidationError, type StagedCallRecord, parseStagedRecord } from './wire.js';

/** A rebuild failure; `reason` is the reference's verification code. */
export class LineageError extends CaptureValidationError {}

export interface LineageManifest {
  /** The capture key of the attempt whose lineage is rebuilt. */
  rollout_id: string;
  records: readonly Record<string, unknown>[];
}

export interface LinearizedRollout {
  rollout_id: string;
  token_ids: number[];
  masks: number[];
  logprobs: number[];
  /** Call ids root first. */
  call_ids: string[];
  /** Leading prompt tokens of the root (mask 0). */
  prompt_len: number;
  weight_versions: number[];
}

function fail(reason: string, detail: string): never {
  throw new LineageError(reason, detail);
}

const COMPARED = [
  'model_call_id',
  'parent_call_id',
  'prev_len',
  'delta_len',
  'cum_len',
  'weight_version',
  'digest',
  'extras_digest',
  'chain_hash',
  'cumulative_hash',
] as const;

/** Whether a row stamped `stamp` may belong to the lineage of `key`. */
export function acceptsCaptureKey(key: string, stamp: string): boolean {
  try {
    const owner = parseCaptureKey(key);
    const staged = parseCaptureKey(stamp);
    return staged.rollout_id === owner.rollout_id && staged.attempt <= owner.attempt;
  } catch {
    return false;
  }
}

interface Row {
  model_call_id: string;
  parent_call_id: string | null;
  prev_len: number;
  cum_len: number;
  staging_key: string;
  record: StagedCallRecord;
}

function checkRow(
  key: string,
  raw: Record<string, unknown>,
  staged: (stagingKey: string) => unknown,
): Row {
  const id = String(raw.model_call_id);
  const stagingKey = raw.staging_key;
  if (typeof stagingKey !== 'string' || stagingKey === '')
    fail('invalid_snapshot', `row ${id} names no staging key`);
  const stamp =
    typeof raw.capture_key === 'string' && raw.capture_key !== '' ? raw.capture_key : key;
  if (!acceptsCaptureKey(key, stamp)) {
    fail(
      'foreign_capture_key',
      `row ${id} was staged by ${stamp}, not by ${key} or an earlier attempt`,
    );
  }
  const value = staged(stagingKey);
  if (value === undefined) fail('invalid_snapshot', `no staged record under ${stagingKey}`);
  const record = parseStagedRecord(value);
  verifyStagedRecord(record);
  if (record.rollout_id !== stamp)
    fail('wrong_rollout', `staged record of ${id} belongs to ${record.rollout_id}`);
  for (const field of COMPARED) {
    if (record[field] !== raw[field])
      fail(`wrong_${field}`, `row ${id}: ${field} differs from the staged record`);
  }
  return {
    model_call_id: id,
    parent_call_id: record.parent_call_id,
    prev_len: record.prev_len,
    cum_len: record.cum_len,
    staging_key: stagingKey,
    record,
  };
}

/** Every row of the manifest, checked against its staged record, by call id. */
function checkedRows(
  key: string,
  manifest: LineageManifest,
  staged: (stagingKey: string) => unknown,
): Map<string, Row> {
  if (manifest.records.length === 0) fail('empty_manifest', `rollout ${key} has no rows`);
  const byId = new Map<string, Row>();
  const keys = new Set<string>();
  for (const raw of manifest.records) {
    const row = checkRow(key, raw, staged);
    if (byId.has(row.model_call_id))
      fail('duplicate_manifest_row', `call ${row.model_call_id} twice`);
    if (keys.has(row.staging_key))
      fail('duplicate_staging_key', `staging key ${row.staging_key} twice`);
    byId.set(row.model_call_id, row);
    keys.add(row.staging_key);
  }
  return byId;
}

/** The lineage ending at `terminal`, root first: each parent present, its length continued. */
function lineageOf(terminal: Row, byId: ReadonlyMap<string, Row>): Row[] {
  const chain: Row[] = [];
  const seen = new Set<string>();
  for (let row: Row | undefined = terminal; row;) {
    if (seen.has(row.model_call_id))
      fail('lineage_cycle', `call ${row.model_call_id} is its own ancestor`);
    seen.add(row.model_call_id);
    chain.unshift(row);
    if (row.parent_call_id === null) break;
    const parent = byId.get(row.parent_call_id);
    if (!parent)
      fail(
        'missing_parent',
        `parent ${row.parent_call_id} of ${row.model_call_id} is not in the manifest`,
      );
    if (parent.cum_len !== row.prev_len) {
      fail(
        'parent_length_mismatch',
        `${row.model_call_id} continues ${row.prev_len} tokens, parent has ${parent.cum_len}`,
      );
    }
    row = parent;
  }
  return chain;
}

/** The chain's tokens end to end, each call's chain hash recomputed from its parent's. */
function linearize(key: string, chain: readonly Row[]): LinearizedRollout {
  const out: LinearizedRollout = {
    rollout_id: key,
    token_ids: [],
    masks: [],
    logprobs: [],
    call_ids: [],
    prompt_len: 0,
    weight_versions: [],
  };
  let chainHash: string | null = null;
  for (const row of chain) {
    const r = row.record;
    if (!r.masks.includes(1))
      fail('empty_generation', `call ${row.model_call_id} generated nothing`);
    // Prompt carry (mask 0) comes before generated tokens (mask 1) within a call.
    if (r.masks.some((m, i) => m === 0 && i > 0 && r.masks[i - 1] === 1)) {
      fail('invalid_mask_order', `call ${row.model_call_id} carries prompt after generated tokens`);
    }
    chainHash = computeChainHash(chainHash, r.token_ids_delta);
    if (chainHash !== r.chain_hash)
      fail('chain_hash_mismatch', `call ${row.model_call_id} does not chain from its parent`);
    out.token_ids.push(...r.token_ids_delta);
    out.masks.push(...r.masks);
    out.logprobs.push(...r.logprobs);
    out.call_ids.push(row.model_call_id);
    out.weight_versions.push(r.weight_version);
  }
  out.prompt_len = out.masks.indexOf(1);
  return out;
}

/**
 * Verifies `manifest` against the staged records and linearizes the lineage ending at
 * `terminalCallId` (default: the last row of the manifest).
 */
export function verifyAndLinearize(
  manifest: LineageManifest,
  staged: (stagingKey: string) => unknown,
  terminalCallId?: string,
): LinearizedRollout {
  const key = captureKey(parseCaptureKey(manifest.rollout_id));
  const byId = checkedRows(key, manifest, staged);
  const terminalId =
    terminalCallId ?? String(manifest.records[manifest.records.length - 1]?.model_call_id);
  const terminal = byId.get(terminalId);
  if (!terminal) fail('missing_terminal', `terminal call ${terminalId} is not in the manifest`);
  const out = linearize(key, lineageOf(terminal, byId));
  if (hashTokenIds(out.token_ids) !== terminal.record.cumulative_hash) {
    fail(
      'cumulative_hash_mismatch',
      `the tokens of ${terminalId} do not hash to its cumulative hash`,
    );
  }
  return out;
}
