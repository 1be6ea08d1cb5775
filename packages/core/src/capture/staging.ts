/**
 * Worker staging helpers (reference §2.8): what an inference worker does with a call's
 * `ng_capture` admission. `beginCall` validates it (and a generation-cut continuation against the
 * staged prefix snapshot), `buildPrefixRecord` snapshots a live call without completing it,
 * `buildGenerationChunkRecord` stages only newly generated tokens, and `completeCall` builds the
 * final record through `buildPrefixRecord` and returns the commit coordinates. Every record's
 * staging digest is computed exactly once, when the record is built.
 */
import {
  EXTRAS_DIGEST_VERSION,
  STAGING_DIGEST_VERSION,
  STAGING_SCHEMA_VERSION,
  type StagingDigestFn,
  computeChainHash,
  extrasDigest,
  hashTokenIds,
  stagingDigest,
} from './hashes.js';
import {
  type CaptureAdmission,
  CaptureValidationError,
  type CommitCoords,
  type GenerationCutContinuation,
  type StagedCallRecord,
  parseCaptureAdmission,
} from './wire.js';

/** What a staged record is built from; the lengths, extras digest and digest are derived. */
export interface StagedComponents {
  rollout_id: string;
  model_call_id: string;
  parent_call_id: string | null;
  mode: 'token_in' | 'text';
  prev_len: number;
  weight_version: number;
  token_ids_delta: number[];
  masks: number[];
  logprobs: number[];
  extras: unknown;
  chain_hash: string;
  cumulative_hash: string;
}

/** Builds a record from its components, computing its digest once. */
export function stagedRecordFromComponents(
  c: StagedComponents,
  digest: StagingDigestFn = stagingDigest,
): StagedCallRecord {
  const fields = {
    schema_version: STAGING_SCHEMA_VERSION,
    rollout_id: c.rollout_id,
    model_call_id: c.model_call_id,
    parent_call_id: c.parent_call_id,
    mode: c.mode,
    prev_len: c.prev_len,
    delta_len: c.token_ids_delta.length,
    cum_len: c.prev_len + c.token_ids_delta.length,
    weight_version: c.weight_version,
    token_ids_delta: c.token_ids_delta,
    masks: c.masks,
    logprobs: c.logprobs,
    extras: c.extras,
    extras_digest: extrasDigest(c.extras),
    chain_hash: c.chain_hash,
    cumulative_hash: c.cumulative_hash,
  };
  return { ...fields, digest: digest(fields) };
}

/** Recomputes a stored record's digests: any tampering with tokens, counts or hashes fails. */
export function verifyStagedRecord(record: StagedCallRecord): void {
  if (
    extrasDigest(record.extras) !== record.extras_digest ||
    stagingDigest(record) !== record.digest
  ) {
    throw new CaptureValidationError(
      'corrupt_digest',
      `staged record of call ${record.model_call_id} does not match its digest`,
    );
  }
}

function fail(reason: string, detail: string): never {
  throw new CaptureValidationError(reason, detail);
}

const sameIds = (a: readonly number[], b: readonly number[]): boolean =>
  a.length === b.length && a.every((v, i) => v === b[i]);

/** A call between `beginCall` and `completeCall`. */
export interface LiveCall {
  readonly admission: CaptureAdmission;
  /** The parent's tokens (length `prev_len`). */
  readonly prefixTokenIds: readonly number[];
  readonly weightVersion: number;
  /** The cut snapshot this call continues, validated against the admission. */
  readonly cut: { snapshot: StagedCallRecord; continuation: GenerationCutContinuation } | null;
  readonly digest: StagingDigestFn;
  /** Generated tokens already staged by chunk records, and the last chunk's record. */
  stagedGenerated: number;
  lastChunk: StagedCallRecord | null;
  completed: boolean;
}

export interface BeginCallOptions {
  /** The parent's tokens: inline in the admission, or fetched by the caller for a staging chain. */
  prefixTokenIds?: readonly number[];
  /** The worker's current policy version. */
  weightVersion: number;
  /** The staged prefix snapshot named by the admission's generation cut. */
  generationCut?: StagedCallRecord;
  /** The keys the snapshot was fetched under. */
  generationCutStagingKeys?: readonly string[];
  /** The digest function (tests count calls through it). */
  digest?: StagingDigestFn;
}

function resolvePrefix(
  admission: CaptureAdmission,
  fetched: readonly number[] | undefined,
): number[] {
  const inline = admission.required_prefix_token_ids;
  if (admission.mode === 'text') {
    if ((fetched ?? []).length > 0) fail('invalid_prefix', 'a text root takes no prefix tokens');
    return [];
  }
  if (fetched !== undefined && inline.length > 0 && !sameIds(fetched, inline)) {
    fail('invalid_prefix', 'fetched prefix conflicts with the inline prefix');
  }
  const prefix = [...(fetched ?? inline)];
  if (prefix.length !== admission.prev_len) {
    fail('invalid_prefix', `prefix has ${prefix.length} tokens, prev_len is ${admission.prev_len}`);
  }
  return prefix;
}

/** Checks a cut snapshot against the continuation and the replacement call's own admission. */
function checkCut(
  admission: CaptureAdmission,
  prefix: readonly number[],
  snapshot: StagedCallRecord,
  keys: readonly string[] | undefined,
  weightVersion: number,
): GenerationCutContinuation {
  const c = admission.generation_cut;
  if (c === null) fail('cut_not_authorized', 'the admission authorizes no generation cut');
  if (keys === undefined || !sameStrings(keys, c.staging_keys)) {
    fail('cut_staging_keys_mismatch', 'fetched keys differ from the continuation staging keys');
  }
  if (snapshot.rollout_id !== c.source_capture_key)
    fail('cut_source_mismatch', 'snapshot is not from the source capture key');
  if (snapshot.model_call_id !== c.source_model_call_id)
    fail('cut_source_mismatch', 'snapshot is not the source call');
  if (snapshot.digest !== c.prefix_digest)
    fail('cut_digest_mismatch', 'snapshot digest differs from prefix_digest');
  verifyStagedRecord(snapshot);
  if (
    snapshot.parent_call_id !== admission.parent_call_id ||
    snapshot.prev_len !== admission.prev_len ||
    snapshot.mode !== admission.mode
  ) {
    fail(
      'cut_lineage_mismatch',
      'snapshot parent, prev_len or mode differ from the replacement call',
    );
  }
  const generated = snapshot.masks.filter((m) => m === 1).length;
  if (generated !== c.prefix_token_count) {
    fail(
      'cut_token_count_mismatch',
      `snapshot has ${generated} generated tokens, continuation says ${c.prefix_token_count}`,
    );
  }
  if (snapshot.weight_version > weightVersion) {
    fail(
      'cut_policy_newer',
      `snapshot policy ${snapshot.weight_version} is newer than ${weightVersion}`,
    );
  }
  // The snapshot's digest covers only its own fields: recompute its hashes from the replacement's
  // parent, so a prefix built on other parent tokens (same parent id and length) is refused.
  if (
    computeChainHash(admission.parent_chain_hash, snapshot.token_ids_delta) !==
      snapshot.chain_hash ||
    hashTokenIds([...prefix, ...snapshot.token_ids_delta]) !== snapshot.cumulative_hash
  ) {
    fail(
      'cut_parent_tokens_mismatch',
      "the cut prefix does not extend the replacement call's parent tokens",
    );
  }
  return c;
}

function sameStrings(a: readonly string[], b: readonly string[]): boolean {
  return a.length === b.length && a.every((v, i) => v === b[i]);
}

/** Validates a call's admission (and its cut, if any) and opens it for staging. */
export function beginCall(admissionValue: unknown, options: BeginCallOptions): LiveCall {
  const admission = parseCaptureAdmission(admissionValue);
  if (!Number.isSafeInteger(options.weightVersion) || options.weightVersion < 0) {
    fail('invalid_weight_version', 'the policy version must be a non-negative integer');
  }
  const prefix = resolvePrefix(admission, options.prefixTokenIds);
  let cut: LiveCall['cut'] = null;
  if (options.generationCut !== undefined) {
    const continuation = checkCut(
      admission,
      prefix,
      options.generationCut,
      options.generationCutStagingKeys,
      options.weightVersion,
    );
    cut = { snapshot: options.generationCut, continuation };
  } else if (admission.generation_cut !== null) {
    fail(
      'cut_snapshot_missing',
      'the admission carries a generation cut but no snapshot was given',
    );
  }
  return {
    admission,
    prefixTokenIds: prefix,
    weightVersion: options.weightVersion,
    cut,
    digest: options.digest ?? stagingDigest,
    stagedGenerated: 0,
    lastChunk: null,
    completed: false,
  };
}

/**
 * The prompt a continued call must decode from: the parent's tokens and the cut's delta (whose
 * generated tail the call does not generate again).
 */
export function continuedPrompt(call: LiveCall): number[] {
  return call.cut
    ? [...call.prefixTokenIds, ...call.cut.snapshot.token_ids_delta]
    : [...call.prefixTokenIds];
}

/**
 * Snapshots a live call without completing it: prompt carry (mask 0) then generated tokens
 * (mask 1). A continued call's record is the cut's delta plus the new tokens, stamped with the
 * oldest contributing policy version.
 */
export function buildPrefixRecord(
  call: LiveCall,
  promptTokenIds: readonly number[],
  generated: readonly number[],
  logprobs: readonly number[],
  extras: unknown = null,
): StagedCallRecord {
  const { admission } = call;
  if (generated.length !== logprobs.length)
    fail('invalid_generation', 'one logprob per generated token');
  let delta: number[];
  let masks: number[];
  let lps: number[];
  let weight = call.weightVersion;
  if (call.cut) {
    const { snapshot } = call.cut;
    if (!sameIds(promptTokenIds, continuedPrompt(call))) {
      fail('invalid_prompt', 'a continued call decodes from its prefix plus the cut delta');
    }
    delta = [...snapshot.token_ids_delta, ...generated];
    masks = [...snapshot.masks, ...generated.map(() => 1)];
    lps = [...snapshot.logprobs, ...logprobs];
    weight = Math.min(weight, snapshot.weight_version);
  } else {
    if (!sameIds(promptTokenIds.slice(0, admission.prev_len), call.prefixTokenIds)) {
      fail('invalid_prompt', 'the prompt does not start with the parent tokens');
    }
    const carry = promptTokenIds.slice(admission.prev_len);
    delta = [...carry, ...generated];
    masks = [...carry.map(() => 0), ...generated.map(() => 1)];
    lps = [...carry.map(() => 0), ...logprobs];
  }
  if (delta.length === 0) fail('empty_generation', 'a staged record needs at least one token');
  return stagedRecordFromComponents(
    {
      rollout_id: admission.rollout_id,
      model_call_id: admission.model_call_id,
      parent_call_id: admission.parent_call_id,
      mode: admission.mode,
      prev_len: admission.prev_len,
      weight_version: weight,
      token_ids_delta: delta,
      masks,
      logprobs: lps,
      extras,
      chain_hash: computeChainHash(admission.parent_chain_hash, delta),
      cumulative_hash: hashTokenIds([...call.prefixTokenIds, ...delta]),
    },
    call.digest,
  );
}

/**
 * Stages only the tokens generated since the last chunk, for a worker that flushes a long
 * generation in chunks. The first chunk is the call's prefix record; each later chunk continues
 * the previous one's chain (parent = the call itself, prev_len = what earlier chunks cover).
 */
export function buildGenerationChunkRecord(
  call: LiveCall,
  promptTokenIds: readonly number[],
  generated: readonly number[],
  logprobs: readonly number[],
): StagedCallRecord {
  const previous = call.lastChunk;
  let record: StagedCallRecord;
  if (previous === null) {
    record = buildPrefixRecord(call, promptTokenIds, generated, logprobs);
  } else {
    const fresh = generated.slice(call.stagedGenerated);
    if (fresh.length === 0) fail('empty_generation', 'no tokens generated since the last chunk');
    record = stagedRecordFromComponents(
      {
        rollout_id: call.admission.rollout_id,
        model_call_id: call.admission.model_call_id,
        parent_call_id: call.admission.model_call_id,
        mode: 'token_in',
        prev_len: previous.cum_len,
        weight_version: call.weightVersion,
        token_ids_delta: fresh,
        masks: fresh.map(() => 1),
        logprobs: logprobs.slice(call.stagedGenerated),
        extras: null,
        chain_hash: computeChainHash(previous.chain_hash, fresh),
        cumulative_hash: hashTokenIds([...promptTokenIds, ...generated]),
      },
      call.digest,
    );
  }
  call.stagedGenerated = generated.length;
  call.lastChunk = record;
  return record;
}

/** The commit coordinates of a staged record (what rides the response in `ng_commit_coords`). */
export function commitCoords(record: StagedCallRecord, stagingKey: string): CommitCoords {
  return {
    schema_version: STAGING_SCHEMA_VERSION,
    digest_version: STAGING_DIGEST_VERSION,
    extras_digest_version: EXTRAS_DIGEST_VERSION,
    rollout_id: record.rollout_id,
    model_call_id: record.model_call_id,
    parent_call_id: record.parent_call_id,
    prev_len: record.prev_len,
    delta_len: record.delta_len,
    cum_len: record.cum_len,
    weight_version: record.weight_version,
    disposition: 'staged',
    digest: record.digest,
    extras_digest: record.extras_digest,
    staging_key: stagingKey,
    chain_hash: record.chain_hash,
    cumulative_hash: record.cumulative_hash,
  };
}

/** The default staging key of an ordinary call: `<capture key>/<model call id>`. */
export function defaultStagingKey(admission: CaptureAdmission): string {
  return `${admission.rollout_id}/${admission.model_call_id}`;
}

/**
 * Completes a call: builds its record through `buildPrefixRecord`, and claims completion only
 * once the record is valid (a failed build leaves the call open).
 */
export function completeCall(
  call: LiveCall,
  promptTokenIds: readonly number[],
  generated: readonly number[],
  logprobs: readonly number[],
  stagingKey: string = defaultStagingKey(call.admission),
): { record: StagedCallRecord; coords: CommitCoords } {
  if (call.completed)
    fail('call_completed', `call ${call.admission.model_call_id} is already complete`);
  const record = buildPrefixRecord(call, promptTokenIds, generated, logprobs);
  call.completed = true;
  return { record, coords: commitCoords(record, stagingKey) };
}
