/**
 * The model participant (kind `model`): the policy gate's side of the checkpoint protocol.
 *
 * - prepare closes admission; it is ready once no response is streaming (held ones never block).
 * - commit exports each in-scope episode's ledger rows minus the rows of calls not delivered.
 * - restore (only on a server that has served no call) imports each episode's rows under its next
 *   attempt, then retires the ledgers of the attempts it continues and their earlier ones.
 * - retire cancels and waits for the calls of the attempt and its earlier ones, then retires their
 *   ledgers.
 */
import {
  captureKey,
  CheckpointError,
  covers,
  decodeJson,
  encodeJson,
  type EpisodeId,
  CheckpointStateError,
  type JsonObject,
  nextAttempt,
  parseCaptureKey,
} from '@ckpt-gym/core/protocol';
import {
  type AdmissionRequest,
  BaseParticipant,
  type CheckpointRecord,
  DEFER_DECODE_MIN_BYTES,
  type PrepareReport,
  prepareReport,
  type RawRecord,
  RECORD_FIELDS_JSON,
  type RetiredMarks,
} from '@ckpt-gym/core/server';
import { type CutRecord, type GenerationCuts, parseCutRecord } from './cuts.js';
import type { PolicyGate, Ticket } from './gate.js';
import { type CaptureLedger, type LedgerRows, type LedgerTarget, RowTexts } from './ledger.js';
import type { HandedLedgers, KeptRows } from './worker-rules.js';

export interface ModelRecord extends CheckpointRecord {
  /** Ledger rows, token-free; restored rows carry `capture_key`, the attempt that staged them. */
  rows: JsonObject[];
  /** The episode's latest generation cut, if any (at most one). */
  generation_cuts: JsonObject[];
  /** Each row's JSON as the checkpoint holds it (`[ROW_TEXTS][i]` encodes `rows[i]`), if read back. */
  [ROW_TEXTS]?: readonly Buffer[];
  /** The rows' staging keys, when an export knows them without the rows (handed by a worker). */
  [ROW_STAGING_KEYS]?: readonly string[];
}

const ROW_TEXTS: unique symbol = Symbol('model record rows as read back');
const ROW_STAGING_KEYS: unique symbol = Symbol('model record rows staging keys');

/** A row's staging key, if it has one (a non-empty string). */
export function rowStagingKey(row: JsonObject): string | undefined {
  return typeof row.staging_key === 'string' && row.staging_key !== ''
    ? row.staging_key
    : undefined;
}

/** The key named by an untagged call in blockers (prepare reports capture keys). */
export const UNTAGGED_BLOCKER = '(untagged)';

/**
 * Stamps each carried row with the capture key that staged it; a row already stamped keeps its
 * stamp (a chain of restores names the attempt that staged each call), failure rows are untouched.
 */
export function stampRows(rows: readonly JsonObject[], source: string): JsonObject[] {
  return rows.map((row) =>
    row.failure_reason !== undefined ||
    (typeof row.capture_key === 'string' && row.capture_key !== '')
      ? row
      : { ...row, capture_key: source },
  );
}

/** A model record's rows and cuts, checked (a throw names the episode's record). */
function checkedRecord(rows: unknown, cuts: unknown, key: string): ModelRecord {
  const bad = (problem: string) => new CheckpointStateError(`model record ${key}: ${problem}`);
  if (!Array.isArray(rows) || !rows.every((r) => isJsonObject(r))) {
    throw bad('rows must be a list of objects');
  }
  if (!Array.isArray(cuts) || !cuts.every((c) => isJsonObject(c))) {
    throw bad('generation_cuts must be a list of objects');
  }
  if (cuts.length > 1) throw bad(`episode ${key} has more than one undelivered cut`);
  for (const cut of cuts as JsonObject[]) {
    try {
      parseCutRecord(cut);
    } catch (err) {
      throw bad(`invalid generation cut: ${(err as Error).message}`);
    }
  }
  return {
    episode_id: parseCaptureKey(key),
    rows: rows as JsonObject[],
    generation_cuts: cuts as JsonObject[],
  };
}

/**
 * `stampRows` on rows given with their JSON texts, as texts: a row that gets its stamp has it
 * appended to its text (where a spread puts a new key); only a row whose `capture_key` is there
 * but empty or not a string (never written by this server) is encoded again.
 */
function stampRowTexts(
  rows: readonly JsonObject[],
  texts: readonly Buffer[],
  source: string,
): RowTexts {
  const stamp = `"capture_key":${encodeJson(source)}}`;
  // The stamp's bytes, once per record: every row that gets it shares them.
  const tail = Buffer.from(`,${stamp}`);
  const alone = Buffer.from(stamp);
  return new RowTexts(
    rows.map((row, i) => {
      const text = texts[i]!;
      if (row.failure_reason !== undefined) return [text];
      if (typeof row.capture_key === 'string' && row.capture_key !== '') return [text];
      if (Object.hasOwn(row, 'capture_key')) {
        return [Buffer.from(encodeJson({ ...row, capture_key: source }))];
      }
      const open = text.subarray(0, text.length - 1); // without its closing brace
      return [open, Object.keys(row).length === 0 ? alone : tail];
    }),
  );
}

/** The ledger rows a restore installs for `record`'s episode (`source`) under its next attempt. */
function restoredRows(record: ModelRecord | undefined, source: string): LedgerTarget {
  if (record === undefined) return [];
  const texts = record[ROW_TEXTS];
  if (texts === undefined) return stampRows(record.rows, source);
  return stampRowTexts(record.rows, texts, source);
}

/** Sorted staging keys of rows and cuts. */
function stagingKeysOf(record: ModelRecord): string[] {
  const keys = new Set<string>(record[ROW_STAGING_KEYS]);
  if (record[ROW_STAGING_KEYS] === undefined) {
    for (const row of record.rows) {
      const key = rowStagingKey(row);
      if (key !== undefined) keys.add(key);
    }
  }
  for (const cut of record.generation_cuts) {
    const continuation = cut.continuation as JsonObject | undefined;
    const staged = continuation?.staging_keys;
    if (Array.isArray(staged)) for (const k of staged) if (typeof k === 'string') keys.add(k);
  }
  return [...keys].sort();
}

export class PolicyParticipant extends BaseParticipant<ModelRecord> {
  override readonly marks: RetiredMarks;
  /** Replacement attempts a restore installed that no call has entered yet. */
  readonly #restoredTargets = new Set<string>();

  constructor(
    instance: string,
    readonly gate: PolicyGate,
    readonly ledger: CaptureLedger | undefined,
    readonly cuts: GenerationCuts | undefined = undefined,
  ) {
    super('model', instance);
    this.marks = gate.marks;
  }

  /** Wired as the gate's change listener. */
  changed(): void {
    this.notifyChange();
  }

  /**
   * Runs after a call is admitted: the first call of a restored attempt marks it started (in the
   * shared ledger directory too) before it can be held or write a row.
   */
  async afterAdmit(ticket: Ticket): Promise<void> {
    const key = ticket.captureKey;
    if (key === undefined || !this.#restoredTargets.delete(key)) return;
    await this.ledger?.markStarted(key);
  }

  async closeAdmission(): Promise<void> {
    this.gate.close();
  }

  /** The checkpoint's generation-cut round, once admission closed (never fails prepare). */
  async cutRound(request: AdmissionRequest): Promise<void> {
    await this.cuts?.cutRound(request.checkpointId, request.deadlineTs);
  }

  async openAdmission(): Promise<void> {
    this.cuts?.reopened();
    this.gate.open();
  }

  ready(): boolean {
    return this.gate.ready;
  }

  readiness(): PrepareReport {
    const keys = this.gate.streamingKeys().map((k) => (k === '' ? UNTAGGED_BLOCKER : k));
    return prepareReport({
      blockers: keys,
      blockerCount: this.gate.streamingKeyCount,
      counts: {
        inflight: this.gate.inflight,
        held: this.gate.held,
        ...(this.cuts ? { cut_failures: this.cuts.failures, cut_skipped: this.cuts.skipped } : {}),
      },
    });
  }

  async export(scope: readonly EpisodeId[] | null, signal: AbortSignal): Promise<ModelRecord[]> {
    // Rows are published only once a response starts, so an undelivered call has none; the
    // filter stays as a guard.
    const undelivered = this.gate.undeliveredCallIds();
    return exportModelRecords(this.ledger, checkedScope(scope), {
      undelivered,
      cutOf: (key) => this.cuts?.exportCut(key),
      signal,
    });
  }

  validateRecord(record: JsonObject, key: string): ModelRecord {
    return validateModelRecord(record, key);
  }

  validateRawRecord(record: RawRecord, key: string): ModelRecord {
    return validateRawModelRecord(record, key);
  }

  override checkRestore(): void {
    if (this.gate.served) {
      throw new CheckpointError(
        'model restore requires a freshly started model server; this one has served calls',
      );
    }
  }

  async install(records: ModelRecord[], scope: readonly EpisodeId[]): Promise<void> {
    await installLedgers(this.ledger, records, scope);
    for (const [target, cut] of restoredCuts(records, scope)) this.cuts?.install(target, cut);
    for (const episode of scope) this.#restoredTargets.add(captureKey(nextAttempt(episode)));
  }

  restoredPending(): EpisodeId[] {
    return [...this.#restoredTargets].sort().map(parseCaptureKey);
  }

  /**
   * Frees a restored attempt nothing started, without a fence (the controller may still start
   * the rollout over as that attempt); keeps its ledger if a server sharing it started it. The
   * ledger goes first, so a failed delete leaves the attempt pending for the retried commit.
   */
  override async deleteRestored(episode: EpisodeId): Promise<void> {
    const key = captureKey(episode);
    await this.ledger?.deleteUnstarted(key);
    this.#restoredTargets.delete(key);
    this.cuts?.drop(key);
  }

  async retire(episode: EpisodeId): Promise<void> {
    await this.gate.retire(episode);
    this.cuts?.retire(episode);
    for (const key of [...this.#restoredTargets]) {
      if (covers(episode, parseCaptureKey(key))) this.#restoredTargets.delete(key);
    }
    await this.ledger?.retireThrough([episode]);
  }

  override statusExtra(): Record<string, unknown> {
    return { served: this.gate.served, waiting: this.gate.waitingCount };
  }

  override commitReplyExtra(records: ModelRecord[]): Record<string, unknown> {
    return stagingKeysReply(records);
  }
}

/** A model commit names the episodes it continues (a null scope is refused). */
export function checkedScope(scope: readonly EpisodeId[] | null): readonly EpisodeId[] {
  if (scope === null) {
    throw new CheckpointError(
      'model commit needs the episode_ids the controller continues from this checkpoint',
    );
  }
  return scope;
}

/** What the export leaves out and keeps: undelivered calls' rows, and the cut of each key. */
export interface ExportParts {
  readonly undelivered: ReadonlySet<string>;
  readonly cutOf: (key: string) => CutRecord | undefined;
  /** Ledgers policy workers handed as bytes: exported without reading their files. */
  readonly handed?: HandedLedgers;
  readonly signal: AbortSignal;
}

/**
 * Each in-scope episode's record: its ledger rows minus the rows of calls not delivered, and its
 * latest cut; an episode with neither has no record.
 */
export async function exportModelRecords(
  ledger: CaptureLedger | undefined,
  scope: readonly EpisodeId[],
  { undelivered, cutOf, handed, signal }: ExportParts,
): Promise<ModelRecord[]> {
  if (!ledger) return [];
  const keys = scope.map(captureKey);
  const kept = keys.map((key) => handed?.kept(key, undelivered));
  // Only the ledgers no worker handed are read.
  const ledgers = await ledger.exportMany(
    keys.filter((_, i) => kept[i] === undefined),
    signal,
  );
  const records: ModelRecord[] = [];
  let read = 0;
  for (const [i, episode] of scope.entries()) {
    const cut = cutOf(keys[i] as string);
    const cuts = cut ? [{ ...cut } as unknown as JsonObject] : [];
    const handedRows = kept[i];
    const record =
      handedRows === undefined
        ? readRecord(episode, ledgers[read++]!, undelivered, cuts)
        : handedRecord(episode, handedRows, cuts);
    if (record !== undefined) records.push(record);
  }
  return records;
}

/** The record of a ledger's rows, minus those of undelivered calls; none when it holds nothing. */
function readRecord(
  episode: EpisodeId,
  exported: LedgerRows,
  undelivered: ReadonlySet<string>,
  cuts: JsonObject[],
): ModelRecord | undefined {
  const rows: JsonObject[] = [];
  const lines: string[] = [];
  for (const [j, row] of exported.rows.entries()) {
    if (undelivered.has(String(row.model_call_id))) continue;
    rows.push(row);
    lines.push(exported.lines[j]!);
  }
  if (rows.length === 0 && cuts.length === 0) return undefined;
  const record: ModelRecord = { episode_id: episode, rows, generation_cuts: cuts };
  // The rows' JSON is the ledger's, mostly taken when each row was appended.
  record[RECORD_FIELDS_JSON] = ['"rows":[', lines.join(','), cutsJson(cuts)];
  return record;
}

/**
 * The record of rows a worker handed as bytes (undelivered calls' already left out): the commit
 * writes the bytes, and the rows are decoded only if something reads them (a getter: a spread
 * of the record does not copy them).
 */
class HandedRecord implements ModelRecord {
  [field: string]: unknown;
  readonly [RECORD_FIELDS_JSON]: readonly (string | Uint8Array)[];
  readonly [ROW_STAGING_KEYS]: readonly string[];
  readonly #kept: KeptRows;
  #rows: JsonObject[] | undefined;

  constructor(
    readonly episode_id: EpisodeId,
    kept: KeptRows,
    readonly generation_cuts: JsonObject[],
  ) {
    this.#kept = kept;
    this[ROW_STAGING_KEYS] = kept.staging;
    this[RECORD_FIELDS_JSON] = ['"rows":[', ...kept.joined, cutsJson(generation_cuts)];
  }

  get rows(): JsonObject[] {
    return (this.#rows ??= this.#kept.texts.map((text) => decodeJson(utf8(text)) as JsonObject));
  }
}

function handedRecord(
  episode: EpisodeId,
  kept: KeptRows,
  cuts: JsonObject[],
): ModelRecord | undefined {
  // No piece joined: every row was left out (reading `texts` would make a view per row).
  if (kept.joined.length === 0 && cuts.length === 0) return undefined;
  return new HandedRecord(episode, kept, cuts);
}

/** A record's JSON after its rows. */
function cutsJson(cuts: readonly JsonObject[]): string {
  return `],"generation_cuts":${cuts.length === 0 ? '[]' : encodeJson(cuts)}`;
}

function utf8(bytes: Uint8Array): string {
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString('utf8');
}

export function validateModelRecord(record: JsonObject, key: string): ModelRecord {
  return checkedRecord(record.rows, record.generation_cuts ?? [], key);
}

/**
 * As `validateModelRecord` (the rows are decoded and checked now: the install writes them to the
 * ledger files), keeping each row's JSON text so the install writes it without encoding it.
 */
export function validateRawModelRecord(record: RawRecord, key: string): ModelRecord {
  if (record.bytes.length < DEFER_DECODE_MIN_BYTES)
    return validateModelRecord(record.decode(), key);
  const checked = checkedRecord(record.field('rows'), record.field('generation_cuts') ?? [], key);
  checked[ROW_TEXTS] = record.fieldElements('rows')!;
  return checked;
}

/**
 * Installs each in-scope episode's rows under its next attempt (every in-scope episode, with or
 * without a record: the import also clears what dead executions left for its next attempts);
 * attempts 0..N continue as N+1 and never write again.
 */
export async function installLedgers(
  ledger: CaptureLedger | undefined,
  records: readonly ModelRecord[],
  scope: readonly EpisodeId[],
): Promise<void> {
  if (!ledger) {
    if (records.some((r) => r.rows.length > 0)) {
      throw new CheckpointError(
        'checkpoint holds capture-ledger rows but this model server has no capture ledger',
      );
    }
    return;
  }
  const byKey = new Map(records.map((r) => [captureKey(r.episode_id), r]));
  const targets = new Map<string, LedgerTarget>();
  for (const episode of scope) {
    const source = captureKey(episode);
    targets.set(captureKey(nextAttempt(episode)), restoredRows(byKey.get(source), source));
  }
  await ledger.restore(targets, [], scope);
}

/** The restored cut of each in-scope record, under the attempt that continues its episode. */
export function restoredCuts(
  records: readonly ModelRecord[],
  scope: readonly EpisodeId[],
): [string, CutRecord][] {
  const inScope = new Set(scope.map(captureKey));
  const cuts: [string, CutRecord][] = [];
  for (const record of records) {
    const [cut] = record.generation_cuts;
    if (cut && inScope.has(captureKey(record.episode_id))) {
      cuts.push([captureKey(nextAttempt(record.episode_id)), parseCutRecord(cut)]);
    }
  }
  return cuts;
}

/** The commit reply's staging keys: every one the checkpoint refers to, and by episode. */
export function stagingKeysReply(records: readonly ModelRecord[]): Record<string, unknown> {
  const byEpisode: Record<string, string[]> = {};
  const all = new Set<string>();
  for (const record of records) {
    const keys = stagingKeysOf(record);
    byEpisode[captureKey(record.episode_id)] = keys;
    for (const k of keys) all.add(k);
  }
  return { staging_keys: [...all].sort(), staging_keys_by_episode: byEpisode };
}

function isJsonObject(value: unknown): value is JsonObject {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}
