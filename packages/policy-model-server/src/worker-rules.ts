/**
 * The rules of a policy model server with several workers, as small pure pieces (the coordinator
 * and the worker links apply them; nothing here does I/O):
 *
 * - the workers' reports merge into one `PrepareReport` (core's coordinator blocks it while a
 *   worker has not reported, or after one was lost while the checkpoint is open);
 * - the commit's snapshots must come from every worker, none lost since admission closed:
 *   otherwise the rows of a lost worker's undelivered calls would be exported as delivered;
 * - with its snapshot a worker hands the in-scope ledgers it appended as their lines' bytes and
 *   an index (each row's call id and staging key, and length), so the coordinator leaves out
 *   undelivered calls and writes the records without reading a ledger or handling a row's text;
 * - a worker hands the ledgers it appended once its coordinator is ready (the pre-snapshot), so
 *   the commit's snapshot hands only the ledgers changed since and names those the pre-snapshot
 *   no longer speaks for (`snapshotDelta`);
 * - restored attempts stop being pending at their first admitted call on any worker, and only the
 *   first reopen after an install hands the workers its attempts;
 * - a restored cut has one owner: a worker claims it before its call runs, a call that used it
 *   never gives it back;
 * - a model server refuses to restore once any worker served a call, or once any worker left.
 */
import { CheckpointError, covers, type EpisodeId, parseCaptureKey } from '@ckpt-gym/core/protocol';
import { type PrepareReport, prepareReport, WithBytes } from '@ckpt-gym/core/server';

import type { CutRecord, KeptCut } from './cuts.js';
import type { AppendedLedger } from './ledger.js';
import { rowStagingKey, UNTAGGED_BLOCKER } from './participant.js';

/** What one policy worker reports to its coordinator (plain JSON). */
export interface PolicyWorkerReport {
  /** Capture keys with a started response ('' for untagged calls), every one of them. */
  readonly streaming: readonly string[];
  readonly inflight: number;
  readonly held: number;
  /** Present when generation cuts are on. */
  readonly cut_failures?: number;
  readonly cut_skipped?: number;
}

/** What a closed worker holds, for the commit's export (plain JSON). */
export interface PolicyWorkerSnapshot {
  /** `model_call_id`s of admitted tagged calls whose response has not started. */
  readonly undelivered: readonly string[];
  /** The worker's kept generation cuts (at most one per capture key). */
  readonly cuts: readonly KeptCut[];
  /** The index of the ledger rows handed as the reply's bytes (absent: none handed). */
  readonly ledgers?: HandedLedgerIndex;
  /**
   * Present when the snapshot completes the worker's pre-snapshot of this admission generation:
   * the pre-snapshot's ledgers count too, but for the keys in `dropped`.
   */
  readonly presnapshot?: number;
  readonly dropped?: readonly string[];
}

/** What a worker hands once its coordinator is ready: the ledgers it appended (plain JSON). */
export interface PolicyWorkerPresnapshot {
  readonly ledgers: HandedLedgerIndex;
}

/** A ledger as `handLedgers` hands it: its key, rows and their lines. */
export type HandableLedger = Pick<AppendedLedger, 'key' | 'rows' | 'lines'>;

/**
 * The index of the ledger rows a worker hands with its snapshot; their texts are the reply's
 * bytes: each key's rows joined by commas (as a record's `rows` holds them), keys one after
 * another in the order of `keys`.
 */
export interface HandedLedgerIndex {
  readonly keys: readonly string[];
  /** Rows of each key (at least one). */
  readonly rows: readonly number[];
  /** Each row's `model_call_id` as text, for the undelivered filter. */
  readonly ids: readonly string[];
  /** Each row's staging key, or null (for the commit reply). */
  readonly staging: readonly (string | null)[];
  /** Each row's text's length in bytes. */
  readonly lengths: readonly number[];
}

/**
 * A worker's snapshot reply: its JSON, and the ledgers it handed (added to `handed`), with those of
 * its pre-snapshot (`pre`) it did not drop when the reply completes one. A reply that completes a
 * pre-snapshot the coordinator does not hold fails the export.
 */
export function snapshotOf(
  reply: unknown,
  handed: HandedLedgers,
  pre?: Presnapshot,
): PolicyWorkerSnapshot {
  const { body: snapshot, bytes } = bodyAndBytes<PolicyWorkerSnapshot>(reply);
  if (snapshot.ledgers !== undefined) handed.add(snapshot.ledgers, bytes);
  if (snapshot.presnapshot !== undefined) {
    if (pre === undefined) {
      throw new CheckpointError(
        "a policy worker's snapshot completes a pre-snapshot never received",
      );
    }
    handed.addPresnapshot(pre, new Set(snapshot.dropped));
  }
  return snapshot;
}

/** A worker's pre-snapshot as its coordinator keeps it: each key's span of the handed bytes. */
export interface Presnapshot {
  readonly spans: ReadonlyMap<string, HandedKey>;
}

/**
 * Indexes a pre-snapshot reply as it arrives, so the commit only looks its keys up; throws
 * `CheckpointError` when its index does not match its bytes.
 */
export function presnapshotOf(reply: unknown): Presnapshot {
  const { body, bytes } = bodyAndBytes<PolicyWorkerPresnapshot>(reply);
  return { spans: keyedSpans(body.ledgers, bytes) };
}

function bodyAndBytes<T>(reply: unknown): { body: T; bytes: Uint8Array } {
  return reply instanceof WithBytes
    ? { body: reply.body as unknown as T, bytes: reply.bytes }
    : { body: reply as T, bytes: new Uint8Array() };
}

/**
 * What the commit's snapshot of `keys` hands against a pre-snapshot that handed `pre` (each key's
 * stamp): the ledgers appended or changed since (`changed`), and the keys the pre-snapshot no
 * longer speaks for (`dropped`: changed, or no longer known as appended, so read from disk).
 */
export function snapshotDelta<L extends Pick<AppendedLedger, 'key' | 'stamp'>>(
  pre: ReadonlyMap<string, string>,
  current: readonly L[],
  keys: readonly string[],
): { changed: L[]; dropped: string[] } {
  const now = new Map(current.map((ledger) => [ledger.key, ledger]));
  const changed: L[] = [];
  const dropped: string[] = [];
  for (const key of keys) {
    const ledger = now.get(key);
    const stamp = pre.get(key);
    if (ledger !== undefined && ledger.stamp === stamp) continue;
    if (stamp !== undefined) dropped.push(key);
    if (ledger !== undefined) changed.push(ledger);
  }
  return { changed, dropped };
}

/**
 * The newest of `ledgers` (given oldest first) whose rows' texts fit in `maxChars`: a pre-snapshot
 * hands those, so ledgers the trainer never retired do not all cross at every checkpoint; a
 * ledger left out is handed by the commit's snapshot if the commit's scope names it.
 */
export function newestWithin<L extends HandableLedger>(
  ledgers: readonly L[],
  maxChars: number,
): L[] {
  let chars = 0;
  let first = ledgers.length;
  while (first > 0) {
    for (const line of ledgers[first - 1]!.lines) chars += line.length;
    if (chars > maxChars) break;
    first -= 1;
  }
  return ledgers.slice(first);
}

/**
 * The ledgers a worker hands: their index and their rows' texts as bytes. Each line is encoded
 * once, straight into the one buffer (no joined string, which a commit at 8k rollouts spent about
 * as long building and encoding again as the rest of the snapshot).
 */
export function handLedgers(ledgers: readonly HandableLedger[]): {
  index: HandedLedgerIndex;
  bytes: Buffer;
} {
  const index = { keys: [], rows: [], ids: [], staging: [], lengths: [] } as {
    [F in keyof HandedLedgerIndex]: HandedLedgerIndex[F][number][];
  };
  let total = 0;
  for (const { key, rows, lines } of ledgers) {
    index.keys.push(key);
    index.rows.push(rows.length);
    for (const [i, row] of rows.entries()) {
      index.ids.push(String(row.model_call_id));
      index.staging.push(rowStagingKey(row) ?? null);
      const length = Buffer.byteLength(lines[i]!);
      index.lengths.push(length);
      total += length;
    }
  }
  total += index.lengths.length - index.keys.length; // the commas between a key's rows
  return { index, bytes: joinedBytes(ledgers, total) };
}

/** Every key's lines, each key's joined by commas, written into one buffer of `total` bytes. */
function joinedBytes(ledgers: readonly HandableLedger[], total: number): Buffer {
  const bytes = Buffer.allocUnsafe(total);
  let at = 0;
  for (const { rows, lines } of ledgers) {
    for (let i = 0; i < rows.length; i++) {
      if (i > 0) bytes[at++] = COMMA;
      at += bytes.write(lines[i]!, at, 'utf8');
    }
  }
  return bytes;
}

const COMMA = 0x2c;

/** One key's kept rows, as views of the bytes a worker handed. */
export interface KeptRows {
  /** Each kept row's text. */
  readonly texts: Uint8Array[];
  /** The kept rows' texts joined by commas, in as few pieces as may be (one when none was left out). */
  readonly joined: (string | Uint8Array)[];
  /** The kept rows' staging keys. */
  readonly staging: string[];
}

/** One handed key: where its rows are in a worker's index and bytes. */
export interface HandedKey {
  readonly index: HandedLedgerIndex;
  readonly bytes: Uint8Array;
  /** Its first row in the index's row arrays, its rows, and its bytes' span. */
  readonly row: number;
  readonly count: number;
  readonly start: number;
  readonly end: number;
}

/** Each key's span of `bytes`, or undefined when the index does not match them exactly. */
function handedSpans(index: HandedLedgerIndex, bytes: Uint8Array): HandedKey[] | undefined {
  const fields = [index.keys, index.rows, index.ids, index.staging, index.lengths];
  if (!fields.every((field) => Array.isArray(field))) return undefined;
  const rowCount = index.ids.length;
  if (index.keys.length !== index.rows.length) return undefined;
  if (index.staging.length !== rowCount || index.lengths.length !== rowCount) return undefined;
  const spans: HandedKey[] = [];
  let row = 0;
  let start = 0;
  for (const count of index.rows) {
    if (!Number.isSafeInteger(count) || count < 1 || row + count > rowCount) return undefined;
    let end = start + count - 1; // the commas
    for (let i = row; i < row + count; i++) {
      const length = index.lengths[i]!;
      if (!Number.isSafeInteger(length) || length < 1) return undefined;
      end += length;
    }
    spans.push({ index, bytes, row, count, start, end });
    row += count;
    start = end;
  }
  return row === rowCount && start === bytes.length ? spans : undefined;
}

/** Each key's span of `bytes` by key; throws `CheckpointError` when the index does not match them. */
function keyedSpans(index: HandedLedgerIndex, bytes: Uint8Array): Map<string, HandedKey> {
  const spans = handedSpans(index, bytes);
  if (spans === undefined) {
    throw new CheckpointError("a policy worker's handed ledger rows do not match their bytes");
  }
  return new Map(spans.map((span, k) => [index.keys[k]!, span]));
}

/**
 * The ledgers every worker handed, by key (the first worker handing a key wins: each handed it
 * as its file is).
 */
export class HandedLedgers {
  readonly #keys = new Map<string, HandedKey>();

  /** Adds the keys a worker handed (`CheckpointError` when the index does not match the bytes). */
  add(index: HandedLedgerIndex, bytes: Uint8Array): void {
    this.#adopt(keyedSpans(index, bytes));
  }

  /** Adds the keys of a pre-snapshot but those in `except`. */
  addPresnapshot(pre: Presnapshot, except: ReadonlySet<string>): void {
    this.#adopt(pre.spans, except);
  }

  #adopt(spans: ReadonlyMap<string, HandedKey>, except?: ReadonlySet<string>): void {
    for (const [key, span] of spans) {
      if (!this.#keys.has(key) && !except?.has(key)) this.#keys.set(key, span);
    }
  }

  /** The key's rows minus those of `undelivered` calls; undefined when no worker handed it. */
  kept(key: string, undelivered: ReadonlySet<string>): KeptRows | undefined {
    const handed = this.#keys.get(key);
    if (handed === undefined) return undefined;
    const { index, row, count } = handed;
    if (!anyOf(index.ids, row, count, undelivered)) return new WholeKey(handed);
    const texts: Uint8Array[] = [];
    const staging: string[] = [];
    for (const [n, text] of rowTexts(handed).entries()) {
      if (undelivered.has(index.ids[row + n]!)) continue;
      texts.push(text);
      const stagingKey = index.staging[row + n];
      if (typeof stagingKey === 'string') staging.push(stagingKey);
    }
    const joined = texts.flatMap((text, i) => (i === 0 ? [text] : [',', text]));
    return { texts, joined, staging };
  }
}

/** Whether any of `count` ids from `row` is in `set` (no slice per key: a commit asks 8k times). */
function anyOf(
  ids: readonly string[],
  row: number,
  count: number,
  set: ReadonlySet<string>,
): boolean {
  if (set.size === 0) return false;
  for (let i = row; i < row + count; i++) if (set.has(ids[i]!)) return true;
  return false;
}

/** Each row's text of a handed key, as views of the handed bytes. */
function rowTexts({ index, bytes, row, count, start }: HandedKey): Uint8Array[] {
  const texts: Uint8Array[] = [];
  let at = start;
  for (let i = row; i < row + count; i++) {
    texts.push(bytes.subarray(at, at + index.lengths[i]!));
    at += index.lengths[i]! + 1;
  }
  return texts;
}

/**
 * A key none of whose rows is left out (the usual case): its rows are one view of the handed
 * bytes, and each row's own view is made only if something reads the rows (a commit does not).
 */
class WholeKey implements KeptRows {
  readonly joined: Uint8Array[];
  readonly staging: string[];
  readonly #handed: HandedKey;

  constructor(handed: HandedKey) {
    const { index, bytes, row, count, start, end } = handed;
    this.#handed = handed;
    this.joined = [bytes.subarray(start, end)];
    this.staging = [];
    for (let i = row; i < row + count; i++) {
      const key = index.staging[i];
      if (typeof key === 'string') this.staging.push(key);
    }
  }

  get texts(): Uint8Array[] {
    return rowTexts(this.#handed);
  }
}

/**
 * The one `PrepareReport` of the workers' reports: ready once no worker has a response streaming.
 * (The coordinator also blocks while a worker has not reported, or was lost during the checkpoint.)
 */
export function mergePolicyReports(reports: readonly PolicyWorkerReport[]): PrepareReport {
  const keys = new Set<string>();
  const counts: Record<string, number> = { inflight: 0, held: 0 };
  for (const report of reports) {
    for (const key of report.streaming) keys.add(key === '' ? UNTAGGED_BLOCKER : key);
    counts.inflight! += report.inflight;
    counts.held! += report.held;
    if (report.cut_failures !== undefined) {
      counts.cut_failures = (counts.cut_failures ?? 0) + report.cut_failures;
      counts.cut_skipped = (counts.cut_skipped ?? 0) + (report.cut_skipped ?? 0);
    }
  }
  return prepareReport({ blockers: [...keys].sort(), blockerCount: keys.size, counts });
}

/**
 * Refuses the commit's export unless every worker answered its snapshot and none was lost since
 * admission closed (the export then fails `export_failed`, final for the checkpoint: a later
 * export could take a later cut).
 */
export function checkSnapshots(expected: number, answered: number, lostSinceClose: boolean): void {
  if (lostSinceClose) {
    throw new CheckpointError(
      'a policy worker was lost after admission closed; the rows of its undelivered calls cannot be told apart',
    );
  }
  if (answered < expected) {
    throw new CheckpointError(
      `only ${answered} of ${expected} policy workers answered the commit's snapshot`,
    );
  }
}

/**
 * The rows and cuts the commit leaves out and keeps, from every worker's snapshot: every worker's
 * undelivered calls, and per capture key the latest cut (a worker's newer cut over a restored one
 * the coordinator still holds; between workers, the call admitted last).
 */
export function mergeSnapshots(
  snapshots: readonly PolicyWorkerSnapshot[],
  restoredCuts: ReadonlyMap<string, CutRecord>,
): { undelivered: Set<string>; cuts: Map<string, CutRecord> } {
  const undelivered = new Set<string>();
  const cuts = new Map(restoredCuts);
  const fromWorkers = new Map<string, CutRecord>();
  for (const snapshot of snapshots) {
    for (const id of snapshot.undelivered) undelivered.add(id);
    for (const { key, record } of snapshot.cuts) {
      const seen = fromWorkers.get(key);
      if (!seen || seen.admitted_at <= record.admitted_at) fromWorkers.set(key, record);
    }
  }
  for (const [key, cut] of fromWorkers) cuts.set(key, cut);
  return { undelivered, cuts };
}

/**
 * The coordinator's restored attempts: every attempt a restore continues, until a worker starts
 * it. Only the first reopen after an install hands the workers the attempts; a later reopen hands
 * nothing, so it cannot make an attempt a worker started pending again on another worker.
 */
export class RestoredAttempts {
  readonly #pending = new Set<string>();
  #handOut = false;

  /** A restore installed these replacement attempts (capture keys). */
  installed(keys: Iterable<string>): void {
    for (const key of keys) this.#pending.add(key);
    this.#handOut = true;
  }

  /** A worker admitted the first call of `key`: it is no longer pending. */
  started(key: string): void {
    this.#pending.delete(key);
  }

  /** What a reopen hands the workers: the attempts once after an install, else null. */
  openState(): string[] | null {
    if (!this.#handOut) return null;
    this.#handOut = false;
    return [...this.#pending].sort();
  }

  /** What a joining worker adopts: it has started nothing yet. */
  joinState(): string[] {
    return [...this.#pending].sort();
  }

  /** A worker left: whether it started an attempt is unknown, so none is pending any more. */
  workerLeft(): void {
    this.#pending.clear();
  }

  delete(key: string): void {
    this.#pending.delete(key);
  }

  retire(episode: EpisodeId): void {
    for (const key of [...this.#pending]) {
      if (covers(episode, parseCaptureKey(key))) this.#pending.delete(key);
    }
  }

  pending(): EpisodeId[] {
    return [...this.#pending].sort().map(parseCaptureKey);
  }
}

/**
 * A worker's copy of the restored attempts: the first admitted call of one takes it (true once),
 * so the worker tells the coordinator and marks the shared ledger. `adopt(null)` keeps the copy.
 */
export class WorkerRestoredAttempts {
  #keys = new Set<string>();

  adopt(keys: readonly string[] | null): void {
    if (keys !== null) this.#keys = new Set(keys);
  }

  take(key: string | undefined): boolean {
    return key !== undefined && this.#keys.delete(key);
  }
}

/**
 * The restored cuts a coordinator holds, one owner each: `claim` hands a cut to the first worker
 * asking (and forgets it), `giveBack` takes back one its call did not use (unless the attempt was
 * retired meanwhile, or another cut came in since).
 */
export class RestoredCuts {
  readonly #cuts = new Map<string, CutRecord>();

  install(target: string, record: CutRecord): void {
    this.#cuts.set(target, record);
  }

  claim(key: string): CutRecord | null {
    const record = this.#cuts.get(key) ?? null;
    this.#cuts.delete(key);
    return record;
  }

  giveBack(key: string, record: CutRecord, retired: (episode: EpisodeId) => boolean): void {
    if (retired(parseCaptureKey(key)) || this.#cuts.has(key)) return;
    this.#cuts.set(key, record);
  }

  drop(key: string): void {
    this.#cuts.delete(key);
  }

  retire(episode: EpisodeId): void {
    for (const key of [...this.#cuts.keys()]) {
      if (covers(episode, parseCaptureKey(key))) this.#cuts.delete(key);
    }
  }

  keys(): string[] {
    return [...this.#cuts.keys()].sort();
  }

  get held(): ReadonlyMap<string, CutRecord> {
    return this.#cuts;
  }
}

/**
 * Why a model server with several workers cannot restore, or null: a worker served a call (a
 * ledger it wrote may belong to a live episode), one has not said whether it did, or one left
 * since start (its fresh replacement cannot report what the old one served).
 */
export function restoreRefusal(state: {
  readonly workerLeft: boolean;
  readonly expected: number;
  readonly served: ReadonlyMap<number, boolean>;
}): string | null {
  if (state.workerLeft) {
    return 'model restore requires freshly started policy workers; a worker has left since start';
  }
  for (let index = 1; index <= state.expected; index++) {
    const served = state.served.get(index);
    if (served === undefined) {
      return `model restore requires every policy worker to have joined; worker ${index} has not`;
    }
    if (served) {
      return 'model restore requires freshly started policy workers; a worker has served calls';
    }
  }
  return null;
}
