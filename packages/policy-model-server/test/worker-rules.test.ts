/** The pure rules of a policy model server with several workers (`worker-rules.ts`). */
import { describe, expect, it } from '@jest/globals';
import {
  CheckpointError,
  type EpisodeId,
  captureKey,
  encodeJson,
  type JsonObject,
  parseCaptureKey,
} from '@ckpt-gym/core/protocol';

import { WithBytes } from '@ckpt-gym/core/server';

import { type CutRecord, GenerationCuts } from '../src/cuts.js';
import type { Ticket } from '../src/gate.js';
import {
  checkSnapshots,
  HandedLedgers,
  handLedgers,
  mergePolicyReports,
  mergeSnapshots,
  newestWithin,
  type PolicyWorkerReport,
  RestoredAttempts,
  RestoredCuts,
  restoreRefusal,
  snapshotDelta,
  presnapshotOf,
  snapshotOf,
  WorkerRestoredAttempts,
} from '../src/worker-rules.js';

const quiet: PolicyWorkerReport = { streaming: [], inflight: 0, held: 0 };

function cut(key: string, admittedAt = 1, digest = 'd'): CutRecord {
  return {
    capture_key: key,
    model_call_id: `call-${admittedAt}`,
    request_digest: digest,
    admitted_at: admittedAt,
    cut_id: 'cut',
    continuation: {
      schema_version: 1,
      source_capture_key: key,
      source_model_call_id: `call-${admittedAt}`,
      staging_keys: [],
      prefix_token_count: 3,
      prefix_digest: 'p',
      effective_output_limit: 10,
      terminal_finish_reason: null,
      terminal_stop_reason: null,
    },
  } as unknown as CutRecord;
}

function ticket(id: string, key: string): Ticket {
  return {
    id,
    episode: parseCaptureKey(key),
    captureKey: key,
    admittedAt: 1,
    signal: new AbortController().signal,
    responseStarted: false,
  };
}

function cuts(): GenerationCuts {
  return new GenerationCuts({
    serverName: 'policy',
    url: 'http://127.0.0.1:9/unused',
    token: 't',
    control: undefined as never,
    logger: undefined as never,
  });
}

describe('merging worker reports', () => {
  it('is ready once no worker has a response streaming, with the counts added up', () => {
    const report = mergePolicyReports([
      { ...quiet, inflight: 2, held: 2, cut_failures: 1, cut_skipped: 0 },
      { ...quiet, inflight: 3, held: 3, cut_failures: 0, cut_skipped: 2 },
    ]);
    expect(report).toEqual({
      ready: true,
      blockers: [],
      blocker_count: 0,
      counts: { inflight: 5, held: 5, cut_failures: 1, cut_skipped: 2 },
      restarts: [],
    });
  });

  it('lists the streaming keys of every worker once, untagged calls by name', () => {
    const report = mergePolicyReports([
      { ...quiet, streaming: ['r-a0', ''], inflight: 2 },
      { ...quiet, streaming: ['r-a0', 's-a1'], inflight: 2 },
    ]);
    expect(report.ready).toBe(false);
    expect(report.blockers).toEqual(['(untagged)', 'r-a0', 's-a1']);
    expect(report.blocker_count).toBe(3);
  });

  it('one streaming worker blocks even when the others are quiet', () => {
    const report = mergePolicyReports([quiet, { ...quiet, streaming: ['r-a0'], inflight: 1 }]);
    expect(report.ready).toBe(false);
    expect(report.counts).toEqual({ inflight: 1, held: 0 });
  });
});

describe("the commit's snapshots", () => {
  it('fail the export when a worker was lost after admission closed', () => {
    expect(() => checkSnapshots(2, 2, true)).toThrow(/lost after admission closed/);
  });

  it('fail the export when fewer workers answered than expected', () => {
    expect(() => checkSnapshots(2, 1, false)).toThrow(/only 1 of 2 policy workers/);
    expect(() => checkSnapshots(2, 2, false)).not.toThrow();
  });

  it("leave out every worker's undelivered calls and keep the latest cut of each key", () => {
    const restored = new Map([
      ['r-a1', cut('r-a0', 1)],
      ['q-a1', cut('q-a0', 1)],
    ]);
    const merged = mergeSnapshots(
      [
        { undelivered: ['c1'], cuts: [{ key: 'r-a1', record: cut('r-a1', 5) }] },
        { undelivered: ['c2'], cuts: [{ key: 'r-a1', record: cut('r-a1', 7) }] },
      ],
      restored,
    );
    expect([...merged.undelivered].sort()).toEqual(['c1', 'c2']);
    expect(merged.cuts.get('r-a1')?.admitted_at).toBe(7);
    expect(merged.cuts.get('q-a1')).toEqual(cut('q-a0', 1));
  });
});

describe("a worker's handed ledgers", () => {
  const rows: Record<string, JsonObject[]> = {
    'r-a1': [
      { model_call_id: 'c1', staging_key: 's1', logprob: -Infinity },
      { model_call_id: 'c2', staging_key: 's2', text: 'héllo ✓' },
      { model_call_id: 'c3', staging_key: null },
    ],
    's-a1': [{ model_call_id: 'c4', staging_key: 's4' }],
  };
  const appended = Object.entries(rows).map(([key, r]) => ({
    key,
    rows: r,
    lines: r.map((row) => encodeJson(row)),
  }));
  const text = (bytes: readonly (string | Uint8Array)[]) =>
    bytes.map((b) => (typeof b === 'string' ? b : Buffer.from(b).toString('utf8'))).join('');

  it("keep each row's text as bytes, and leave out undelivered calls' rows by the index", () => {
    const { index, bytes } = handLedgers(appended);
    expect(index).toEqual({
      keys: ['r-a1', 's-a1'],
      rows: [3, 1],
      ids: ['c1', 'c2', 'c3', 'c4'],
      staging: ['s1', 's2', null, 's4'],
      lengths: appended.flatMap((l) => l.lines.map((line) => Buffer.byteLength(line))),
    });
    const handed = new HandedLedgers();
    handed.add(index, bytes);
    const all = handed.kept('r-a1', new Set())!;
    expect(all.joined).toHaveLength(1);
    expect(text(all.joined)).toBe(appended[0]!.lines.join(','));
    expect(all.staging).toEqual(['s1', 's2']);
    const kept = handed.kept('r-a1', new Set(['c2', 'c4']))!;
    expect(kept.texts.map((t) => text([t]))).toEqual([
      appended[0]!.lines[0],
      appended[0]!.lines[2],
    ]);
    expect(text(kept.joined)).toBe(`${appended[0]!.lines[0]},${appended[0]!.lines[2]}`);
    expect(kept.staging).toEqual(['s1']);
    expect(handed.kept('s-a1', new Set(['c4']))).toEqual({ texts: [], joined: [], staging: [] });
    expect(handed.kept('t-a1', new Set())).toBeUndefined();
  });

  it("a key none of whose rows is left out is one view of the bytes, and still gives each row's text", () => {
    const { index, bytes } = handLedgers(appended);
    const handed = new HandedLedgers();
    handed.add(index, bytes);
    const all = handed.kept('r-a1', new Set(['c4']))!;
    expect(all.joined).toHaveLength(1);
    expect(all.texts.map((t) => text([t]))).toEqual(appended[0]!.lines);
    expect(all.staging).toEqual(['s1', 's2']);
  });

  it('an index that does not match its bytes fails the export', () => {
    const { index, bytes } = handLedgers(appended);
    const broken = [
      { index, bytes: Buffer.concat([bytes, Buffer.from(' ')]) },
      { index, bytes: bytes.subarray(1) },
      { index: { ...index, lengths: [index.lengths[0]! + 1, index.lengths[1]! - 1, 1, 1] }, bytes },
      { index: { ...index, rows: [2, 1] }, bytes },
      { index: { ...index, rows: [0, 3, 1], keys: ['q-a1', ...index.keys] }, bytes },
      { index: { ...index, staging: index.staging.slice(1) }, bytes },
      { index: { ...index, keys: undefined } as never, bytes },
    ];
    for (const { index: i, bytes: b } of broken) {
      expect(() => new HandedLedgers().add(i, b)).toThrow(/do not match their bytes/);
      // A pre-snapshot is checked as it arrives, not at the commit.
      expect(() => presnapshotOf(new WithBytes({ ledgers: i } as never, b))).toThrow(
        /do not match their bytes/,
      );
    }
  });

  it('the first worker handing a key wins', () => {
    const handed = new HandedLedgers();
    const first = handLedgers([appended[1]!]);
    const other = {
      key: 's-a1',
      rows: [{ model_call_id: 'c9' }],
      lines: ['{"model_call_id":"c9"}'],
    };
    const second = handLedgers([other]);
    handed.add(first.index, first.bytes);
    handed.add(second.index, second.bytes);
    expect(text(handed.kept('s-a1', new Set())!.joined)).toBe(appended[1]!.lines[0]);
  });
});

describe("a worker's pre-snapshot", () => {
  const ledger = (key: string, stamp: string) => ({ key, stamp });

  it('the commit hands a ledger appended or changed since, and drops one changed or no longer known', () => {
    const pre = new Map([
      ['same-a1', '1'],
      ['grown-a1', '1'],
      ['gone-a1', '1'],
      ['out-a1', '1'],
    ]);
    const current = [ledger('same-a1', '1'), ledger('grown-a1', '2'), ledger('new-a1', '1')];
    const keys = ['same-a1', 'grown-a1', 'gone-a1', 'new-a1', 'none-a1'];
    const { changed, dropped } = snapshotDelta(pre, current, keys);
    expect(changed.map((l) => l.key)).toEqual(['grown-a1', 'new-a1']);
    expect(dropped).toEqual(['grown-a1', 'gone-a1']);
  });

  it('hands the newest known ledgers that fit in its budget', () => {
    const ledgers = ['old', 'mid', 'new'].map((key) => ({
      key,
      rows: [{ model_call_id: key }],
      lines: ['x'.repeat(10)],
    }));
    expect(newestWithin(ledgers, 30).map((l) => l.key)).toEqual(['old', 'mid', 'new']);
    expect(newestWithin(ledgers, 29).map((l) => l.key)).toEqual(['mid', 'new']);
    expect(newestWithin(ledgers, 9)).toEqual([]);
  });

  const rowsOf = (key: string, id: string) => ({
    key,
    rows: [{ model_call_id: id }],
    lines: [`{"model_call_id":"${id}"}`],
  });
  const reply = (body: object, ledgers: ReturnType<typeof rowsOf>[]) => {
    const { index, bytes } = handLedgers(ledgers);
    return new WithBytes({ ...body, ledgers: index } as never, bytes);
  };

  it("a snapshot completing it counts the pre-snapshot's ledgers but those it dropped, its own first", () => {
    const pre = reply({}, [rowsOf('r-a1', 'old'), rowsOf('s-a1', 's1'), rowsOf('t-a1', 't1')]);
    const snapshot = reply(
      { undelivered: [], cuts: [], presnapshot: 3, dropped: ['r-a1', 't-a1'] },
      [rowsOf('r-a1', 'new')],
    );
    const handed = new HandedLedgers();
    snapshotOf(snapshot, handed, presnapshotOf(pre));
    const text = (key: string) =>
      handed.kept(key, new Set())?.joined.map((b) => Buffer.from(b as Uint8Array).toString());
    expect(text('r-a1')).toEqual(['{"model_call_id":"new"}']);
    expect(text('s-a1')).toEqual(['{"model_call_id":"s1"}']);
    expect(text('t-a1')).toBeUndefined();
  });

  it('a snapshot completing a pre-snapshot the coordinator never received fails the export', () => {
    const snapshot = reply({ undelivered: [], cuts: [], presnapshot: 3, dropped: [] }, []);
    expect(() => snapshotOf(snapshot, new HandedLedgers())).toThrow(CheckpointError);
  });
});

describe('restored attempts across workers', () => {
  const keys = ['r-a1', 's-a1'];

  it('an attempt stops being pending at its first admitted call on any worker', () => {
    const coordinator = new RestoredAttempts();
    coordinator.installed(keys);
    const worker = new WorkerRestoredAttempts();
    worker.adopt(coordinator.openState());
    expect(worker.take('r-a1')).toBe(true);
    expect(worker.take('r-a1')).toBe(false);
    coordinator.started('r-a1');
    expect(coordinator.pending().map(captureKey)).toEqual(['s-a1']);
  });

  it('only the first reopen after an install hands the workers its attempts', () => {
    const coordinator = new RestoredAttempts();
    coordinator.installed(keys);
    const [first, second] = [new WorkerRestoredAttempts(), new WorkerRestoredAttempts()];
    const opened = coordinator.openState();
    first.adopt(opened);
    second.adopt(opened);
    expect(first.take('r-a1')).toBe(true);
    // The started message has not reached the coordinator yet when the next checkpoint reopens.
    const later = coordinator.openState();
    expect(later).toBeNull();
    first.adopt(later);
    expect(first.take('r-a1')).toBe(false);
    expect(second.take('s-a1')).toBe(true);
  });

  it('a worker joining late adopts the attempts still pending', () => {
    const coordinator = new RestoredAttempts();
    coordinator.installed(keys);
    coordinator.started('r-a1');
    expect(coordinator.joinState()).toEqual(['s-a1']);
  });

  it('a worker leaving leaves no attempt pending (what it started is unknown)', () => {
    const coordinator = new RestoredAttempts();
    coordinator.installed(keys);
    coordinator.workerLeft();
    expect(coordinator.pending()).toEqual([]);
  });

  it('a retire drops the attempts it covers', () => {
    const coordinator = new RestoredAttempts();
    coordinator.installed(keys);
    coordinator.retire({ rollout_id: 'r', attempt: 3 } as EpisodeId);
    expect(coordinator.pending().map(captureKey)).toEqual(['s-a1']);
  });
});

describe('restored cuts across workers', () => {
  it('a restored cut is claimed once across workers', () => {
    const held = new RestoredCuts();
    held.install('r-a1', cut('r-a0'));
    expect(held.claim('r-a1')).toEqual(cut('r-a0'));
    expect(held.claim('r-a1')).toBeNull();
    expect(held.keys()).toEqual([]);
  });

  it('a cut given back is kept unless its attempt was retired meanwhile', () => {
    const held = new RestoredCuts();
    held.giveBack('r-a1', cut('r-a0'), () => true);
    expect(held.keys()).toEqual([]);
    held.giveBack('r-a1', cut('r-a0'), () => false);
    expect(held.keys()).toEqual(['r-a1']);
  });

  it('a call that used its claimed cut never gives it back, and a retry gets no cut', () => {
    const worker = cuts();
    const first = ticket('t1', 'r-a1');
    expect(worker.claimed(first, cut('r-a0'))).toBe(true);
    const call = { ticket: first, requestDigest: 'd', restartReason: null, captured: true };
    expect(worker.register(call)).not.toBeNull();
    expect(worker.left(first)).toBeUndefined();
    const retry = ticket('t2', 'r-a1');
    expect(worker.register({ ...call, ticket: retry })).toBeNull();
    expect(worker.keptCuts()).toEqual([]);
  });

  it('a call that did not use its claimed cut gives it back when it leaves', () => {
    const worker = cuts();
    const first = ticket('t1', 'r-a1');
    worker.claimed(first, cut('r-a0'));
    const call = { ticket: first, requestDigest: 'other', restartReason: null, captured: true };
    expect(worker.register(call)).toBeNull();
    expect(worker.left(first)).toEqual(cut('r-a0'));
    expect(worker.keptCuts()).toEqual([]);
  });
});

describe('restore with several workers', () => {
  const fresh = new Map([
    [1, false],
    [2, false],
  ]);

  it('is allowed on fresh workers that all joined', () => {
    expect(restoreRefusal({ workerLeft: false, expected: 2, served: fresh })).toBeNull();
  });

  it('is refused once any worker served a call', () => {
    const served = new Map([...fresh, [2, true]]);
    expect(restoreRefusal({ workerLeft: false, expected: 2, served })).toMatch(/served calls/);
  });

  it('is refused after a worker left, even if its replacement is fresh', () => {
    expect(restoreRefusal({ workerLeft: true, expected: 2, served: fresh })).toMatch(/has left/);
  });

  it('is refused while a worker has not joined', () => {
    const served = new Map([[1, false]]);
    expect(restoreRefusal({ workerLeft: false, expected: 2, served })).toMatch(/worker 2/);
  });
});
