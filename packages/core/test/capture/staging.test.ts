import {
  type StagingDigestFn,
  computeChainHash,
  hashTokenIds,
  stagingDigest,
} from '../../src/capture/hashes.js';
import { verifyAndLinearize } from '../../src/capture/rebuild.js';
import {
  beginCall,
  buildGenerationChunkRecord,
  buildPrefixRecord,
  completeCall,
  continuedPrompt,
} from '../../src/capture/staging.js';
import {
  type CaptureAdmission,
  type GenerationCutContinuation,
  buildInventory,
  parseCommitCoords,
  rootCaptureAdmission,
  validateReceiptFor,
  type StagedCallRecord,
} from '../../src/capture/wire.js';

const WEIGHT = 7;

function childAdmission(
  key: string,
  id: string,
  parent: StagedCallRecord,
  cut: GenerationCutContinuation | null = null,
): CaptureAdmission {
  return {
    ...rootCaptureAdmission(key, id),
    parent_call_id: parent.model_call_id,
    prev_len: parent.cum_len,
    mode: 'token_in',
    staging_chain: [`${parent.rollout_id}/${parent.model_call_id}`],
    parent_chain_hash: parent.chain_hash,
    generation_cut: cut,
  };
}

/** A root call r/c1: prompt [1,2,3], generated [10,11]. */
function stagedRoot(key = 'r'): StagedCallRecord {
  const call = beginCall(rootCaptureAdmission(key, 'c1'), { weightVersion: WEIGHT });
  return completeCall(call, [1, 2, 3], [10, 11], [-0.1, -0.2]).record;
}

function parentTokens(root: StagedCallRecord): number[] {
  return root.token_ids_delta;
}

function continuationOf(snapshot: StagedCallRecord, key: string): GenerationCutContinuation {
  return {
    schema_version: 2,
    source_capture_key: snapshot.rollout_id,
    source_model_call_id: snapshot.model_call_id,
    staging_keys: [key],
    prefix_token_count: snapshot.masks.filter((m) => m === 1).length,
    prefix_digest: snapshot.digest,
    effective_output_limit: 1024,
  };
}

/** A cut of call c2 (child of the root) after generating [20, 21]. */
function cutChild(root: StagedCallRecord, prefix = parentTokens(root)): StagedCallRecord {
  const live = beginCall(childAdmission('r', 'c2', root), {
    weightVersion: WEIGHT,
    prefixTokenIds: prefix,
  });
  return buildPrefixRecord(live, [...prefix, 4, 5], [20, 21], [-0.3, -0.4]);
}

function countingDigest(): { fn: StagingDigestFn; calls: () => number } {
  let calls = 0;
  return {
    fn: (fields) => {
      calls += 1;
      return stagingDigest(fields);
    },
    calls: () => calls,
  };
}

describe('worker staging helpers', () => {
  it('stages a root call with prompt carry masked 0 and generated tokens masked 1', () => {
    const root = stagedRoot();
    expect(root.token_ids_delta).toEqual([1, 2, 3, 10, 11]);
    expect(root.masks).toEqual([0, 0, 0, 1, 1]);
    expect(root.chain_hash).toBe(computeChainHash(null, [1, 2, 3, 10, 11]));
    expect(root.cumulative_hash).toBe(hashTokenIds([1, 2, 3, 10, 11]));
  });

  it('completeCall returns valid commit coordinates and refuses a second completion', () => {
    const call = beginCall(rootCaptureAdmission('r', 'c1'), { weightVersion: WEIGHT });
    const { coords } = completeCall(call, [1], [2], [-1]);
    expect(parseCommitCoords(coords).staging_key).toBe('r/c1');
    expect(() => completeCall(call, [1], [2], [-1])).toThrow(/call_completed/);
  });

  it('a replacement call continues a cut that extends its parent tokens', () => {
    const root = stagedRoot();
    const snapshot = cutChild(root);
    const call = beginCall(childAdmission('r-a1', 'c3', root, continuationOf(snapshot, 'cutkey')), {
      weightVersion: WEIGHT,
      prefixTokenIds: parentTokens(root),
      generationCut: snapshot,
      generationCutStagingKeys: ['cutkey'],
    });
    const prompt = continuedPrompt(call);
    const { record } = completeCall(call, prompt, [22], [-0.5]);
    expect(record.token_ids_delta).toEqual([4, 5, 20, 21, 22]);
    expect(record.masks).toEqual([0, 0, 1, 1, 1]);
    expect(record.cumulative_hash).toBe(hashTokenIds([...parentTokens(root), 4, 5, 20, 21, 22]));
  });

  it('generation cut resume rejects a prefix built on other parent tokens', () => {
    const root = stagedRoot();
    // Same parent id and length, other tokens: the snapshot's own digest is valid.
    const forged = cutChild(root, [9, 9, 9, 9, 9]);
    const options = {
      weightVersion: WEIGHT,
      prefixTokenIds: parentTokens(root),
      generationCut: forged,
      generationCutStagingKeys: ['cutkey'],
    };
    expect(() =>
      beginCall(childAdmission('r-a1', 'c3', root, continuationOf(forged, 'cutkey')), options),
    ).toThrow(/cut_parent_tokens_mismatch/);
  });

  it('refuses a cut whose keys, digest, token count or policy version do not match', () => {
    const root = stagedRoot();
    const snapshot = cutChild(root);
    const base = {
      weightVersion: WEIGHT,
      prefixTokenIds: parentTokens(root),
      generationCut: snapshot,
      generationCutStagingKeys: ['cutkey'],
    };
    const good = continuationOf(snapshot, 'cutkey');
    const admission = (c: GenerationCutContinuation) => childAdmission('r-a1', 'c3', root, c);
    expect(() =>
      beginCall(admission(good), { ...base, generationCutStagingKeys: ['other'] }),
    ).toThrow(/cut_staging_keys_mismatch/);
    expect(() => beginCall(admission({ ...good, prefix_digest: '0'.repeat(64) }), base)).toThrow(
      /cut_digest_mismatch/,
    );
    expect(() => beginCall(admission({ ...good, prefix_token_count: 3 }), base)).toThrow(
      /cut_token_count_mismatch/,
    );
    expect(() => beginCall(admission({ ...good, source_model_call_id: 'x' }), base)).toThrow(
      /cut_source_mismatch/,
    );
    expect(() => beginCall(admission(good), { ...base, weightVersion: WEIGHT - 1 })).toThrow(
      /cut_policy_newer/,
    );
    expect(() => beginCall(admission(good), { ...base, generationCut: undefined })).toThrow(
      /cut_snapshot_missing/,
    );
  });

  it('a continued call that is cut again stages the old prefix plus the new tail, oldest policy', () => {
    const root = stagedRoot();
    const snapshot = cutChild(root);
    const call = beginCall(childAdmission('r-a1', 'c3', root, continuationOf(snapshot, 'k')), {
      weightVersion: WEIGHT + 1,
      prefixTokenIds: parentTokens(root),
      generationCut: snapshot,
      generationCutStagingKeys: ['k'],
    });
    const again = buildPrefixRecord(call, continuedPrompt(call), [30], [-0.6]);
    expect(again.token_ids_delta).toEqual([4, 5, 20, 21, 30]);
    expect(again.weight_version).toBe(WEIGHT);
    expect(again.rollout_id).toBe('r-a1');
    expect(call.completed).toBe(false);
  });

  it('complete call computes staging digest once', () => {
    const digest = countingDigest();
    const call = beginCall(rootCaptureAdmission('r', 'c1'), {
      weightVersion: WEIGHT,
      digest: digest.fn,
    });
    completeCall(call, [1, 2], [3], [-1]);
    expect(digest.calls()).toBe(1);
  });

  it('prefix record computes staging digest once', () => {
    const digest = countingDigest();
    const call = beginCall(rootCaptureAdmission('r', 'c1'), {
      weightVersion: WEIGHT,
      digest: digest.fn,
    });
    buildPrefixRecord(call, [1, 2], [3], [-1]);
    expect(digest.calls()).toBe(1);
  });

  it('generation chunk record computes staging digest once and stages only new tokens', () => {
    const digest = countingDigest();
    const call = beginCall(rootCaptureAdmission('r', 'c1'), {
      weightVersion: WEIGHT,
      digest: digest.fn,
    });
    const first = buildGenerationChunkRecord(call, [1, 2], [3, 4], [-1, -1]);
    expect(digest.calls()).toBe(1);
    const second = buildGenerationChunkRecord(call, [1, 2], [3, 4, 5, 6], [-1, -1, -1, -1]);
    expect(digest.calls()).toBe(2);
    expect(second.token_ids_delta).toEqual([5, 6]);
    expect(second.prev_len).toBe(first.cum_len);
    expect(second.chain_hash).toBe(computeChainHash(first.chain_hash, [5, 6]));
    expect(second.cumulative_hash).toBe(hashTokenIds([1, 2, 3, 4, 5, 6]));
  });
});

describe('generation-cut wire models', () => {
  const prefixes = [
    {
      ticket_id: 'b',
      rollout_id: 'r2',
      attempt: 0,
      model_call_id: 'c\u00e92',
      admitted_at: 1755600000.25,
    },
    { ticket_id: 'a', rollout_id: 'r', attempt: 1, model_call_id: 'c1', admitted_at: 1755600000.0 },
  ];

  it('the inventory digest is Python json.dumps(sort_keys) byte for byte', () => {
    // python3: sha256(json.dumps(inv, sort_keys=True, separators=(",", ":"))) of the same inventory.
    expect(buildInventory('ck-1', 'policy', prefixes).inventory_digest).toBe(
      '35885b0d46327b8c4b0c74c516ab4c5c73778f397c09357c40d5df6532cae153',
    );
  });

  it('a receipt must ack every ticket of the inventory once, naming its call', () => {
    const inventory = buildInventory('ck-1', 'policy', prefixes);
    const ack = (p: (typeof prefixes)[number]) => ({ ...p, disposition: 'durable_failure' });
    const receipt = {
      checkpoint_id: 'ck-1',
      cut_id: 'cut',
      inventory_digest: inventory.inventory_digest,
      inventory,
      backend_snapshot_id: 'store',
      prefixes: prefixes.map(ack),
    };
    expect(validateReceiptFor(receipt, inventory).prefixes).toHaveLength(2);
    expect(() =>
      validateReceiptFor({ ...receipt, prefixes: [ack(prefixes[0]!)] }, inventory),
    ).toThrow(/receipt_mismatch/);
    expect(() =>
      validateReceiptFor(
        { ...receipt, prefixes: [ack(prefixes[0]!), { ...ack(prefixes[1]!), attempt: 5 }] },
        inventory,
      ),
    ).toThrow(/receipt_mismatch/);
    expect(() =>
      validateReceiptFor(
        {
          ...receipt,
          prefixes: [ack(prefixes[0]!), { ...ack(prefixes[1]!), staging_keys: ['k'] }],
        },
        inventory,
      ),
    ).toThrow(/invalid_ack/);
    expect(() => validateReceiptFor({ ...receipt, extra: 1 }, inventory)).toThrow(
      /invalid_receipt/,
    );
  });

  it('a receipt that does not echo the inventory sent is refused', () => {
    const inventory = buildInventory('ck-1', 'policy', prefixes);
    const receiptEchoing = (echo: typeof inventory) => ({
      checkpoint_id: 'ck-1',
      cut_id: 'cut',
      inventory_digest: inventory.inventory_digest,
      inventory: echo,
      backend_snapshot_id: 'store',
      prefixes: prefixes.map((p) => ({ ...p, disposition: 'durable_failure' })),
    });
    const [first, second] = inventory.active_prefixes as [
      (typeof prefixes)[number],
      (typeof prefixes)[number],
    ];
    expect(validateReceiptFor(receiptEchoing({ ...inventory }), inventory).cut_id).toBe('cut');
    const wrongEchoes = [
      { ...inventory, server_name: 'other-policy' },
      { ...inventory, checkpoint_id: 'ck-2' },
      { ...inventory, inventory_digest: 'f'.repeat(64) },
      { ...inventory, active_prefixes: [first] },
      { ...inventory, active_prefixes: [second, first] },
      { ...inventory, active_prefixes: [first, { ...second, admitted_at: 1 }] },
      { ...inventory, active_prefixes: [first, { ...second, model_call_id: 'other' }] },
    ];
    for (const echo of wrongEchoes) {
      expect(() => validateReceiptFor(receiptEchoing(echo), inventory)).toThrow(
        /does not echo the inventory/,
      );
    }
  });
});

describe('rebuild', () => {
  function lineage(rootKey: string) {
    const root = stagedRoot(rootKey);
    const call = beginCall(childAdmission('r-a1', 'c2', root), {
      weightVersion: WEIGHT,
      prefixTokenIds: root.token_ids_delta,
    });
    const child = completeCall(call, [...root.token_ids_delta, 4], [12], [-1]);
    const store = new Map<string, StagedCallRecord>([
      [`${rootKey}/c1`, root],
      ['r-a1/c2', child.record],
    ]);
    const row = (r: StagedCallRecord, key: string, stamp: string | null) => ({
      ...parseCommitCoords({ ...child.coords, ...pick(r), staging_key: key }),
      capture_key: stamp,
    });
    return { root, child: child.record, store, row };
  }

  function pick(r: StagedCallRecord) {
    return {
      rollout_id: r.rollout_id,
      model_call_id: r.model_call_id,
      parent_call_id: r.parent_call_id,
      prev_len: r.prev_len,
      delta_len: r.delta_len,
      cum_len: r.cum_len,
      weight_version: r.weight_version,
      digest: r.digest,
      extras_digest: r.extras_digest,
      chain_hash: r.chain_hash,
      cumulative_hash: r.cumulative_hash,
    };
  }

  it('linearizes a restored lineage whose carried row names an earlier attempt', () => {
    const { root, child, store, row } = lineage('r');
    const out = verifyAndLinearize(
      { rollout_id: 'r-a1', records: [row(root, 'r/c1', 'r'), row(child, 'r-a1/c2', null)] },
      (k) => store.get(k),
    );
    expect(out.call_ids).toEqual(['c1', 'c2']);
    expect(out.token_ids).toEqual([1, 2, 3, 10, 11, 4, 12]);
    expect(out.prompt_len).toBe(3);
  });

  it('rebuild rejects a carried row stamped with another rollout as foreign_capture_key', () => {
    const { root, child, store, row } = lineage('other');
    expect(() =>
      verifyAndLinearize(
        {
          rollout_id: 'r-a1',
          records: [row(root, 'other/c1', 'other'), row(child, 'r-a1/c2', null)],
        },
        (k) => store.get(k),
      ),
    ).toThrow(/foreign_capture_key/);
  });

  it('rebuild rejects a carried row stamped with a later attempt as foreign_capture_key', () => {
    const { root, store, row } = lineage('r-a2');
    expect(() =>
      verifyAndLinearize({ rollout_id: 'r-a1', records: [row(root, 'r-a2/c1', 'r-a2')] }, (k) =>
        store.get(k),
      ),
    ).toThrow(/foreign_capture_key/);
  });

  it('rebuild detects a tampered staged record and a missing parent', () => {
    const { root, child, store, row } = lineage('r');
    store.set('r/c1', { ...root, token_ids_delta: [1, 2, 3, 10, 99] });
    expect(() =>
      verifyAndLinearize(
        { rollout_id: 'r-a1', records: [row(root, 'r/c1', 'r'), row(child, 'r-a1/c2', null)] },
        (k) => store.get(k),
      ),
    ).toThrow(/corrupt_digest/);
    store.set('r/c1', root);
    expect(() =>
      verifyAndLinearize({ rollout_id: 'r-a1', records: [row(child, 'r-a1/c2', null)] }, (k) =>
        store.get(k),
      ),
    ).toThrow(/missing_parent/);
  });
});
