/**
 * The environment participant: live episodes run on core's `EpisodeSteps`; a checkpoint exports
 * each one's latest boundary with the digest of its task; a restore installs them under the next
 * attempt, where the replacement `/run` continues from that boundary.
 */
import { createHash } from 'node:crypto';

import {
  captureKey,
  CheckpointError,
  CheckpointStateError,
  covers,
  type EpisodeId,
  episodeIdFromJson,
  episodeIdToJson,
  type JsonObject,
  type JsonValue,
  nextAttempt,
  parseCaptureKey,
  RetireIncompleteError,
} from '@ckpt-gym/core/protocol';
import {
  type AdmissionRequest,
  BaseParticipant,
  type Boundary,
  type CheckpointRecord,
  DEFER_DECODE_MIN_BYTES,
  ENCODE_AHEAD_SETTLE_MS,
  type EpisodeContext,
  episodeRunAdmission,
  EpisodeSteps,
  type PrepareReport,
  prepareReport,
  type RawRecord,
  RECORD_FIELDS_JSON,
  type RestoredClaims,
} from '@ckpt-gym/core/server';

export interface EnvironmentRecord extends CheckpointRecord {
  task_digest: string;
  /** Null: no boundary was recorded; the episode starts over from its input. */
  boundary: Boundary | null;
  [field: string]: unknown;
}

// --- the task digest, byte-compatible with Python's json.dumps(sort_keys=True) ----------------

/** Python's float repr: shortest digits, exponent form below 1e-4 and from 1e16 on. */
function pythonNumber(n: number): string {
  if (Number.isNaN(n)) return 'NaN';
  if (n === Infinity) return 'Infinity';
  if (n === -Infinity) return '-Infinity';
  // JSON parsing cannot tell 1 from 1.0; integral values are written as Python ints.
  if (Number.isInteger(n) && Math.abs(n) < 1e16) return Object.is(n, -0) ? '-0.0' : String(n);
  const [mantissa = '', exponent = '0'] = n.toExponential().split('e');
  const exp = Number(exponent);
  if (exp < -4 || exp >= 16) {
    const sign = exp < 0 ? '-' : '+';
    return `${mantissa}e${sign}${String(Math.abs(exp)).padStart(2, '0')}`;
  }
  return String(n);
}

/** Python's ensure_ascii string escaping. */
const NON_ASCII = /[\u007f-\uffff]/;

function pythonString(s: string): string {
  if (!NON_ASCII.test(s)) return JSON.stringify(s);
  return JSON.stringify(s).replace(
    /[\u007f-\uffff]/g,
    (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`,
  );
}

const SURROGATE = /[\ud800-\udfff]/;

/**
 * The object's keys in code-point order. Without a surrogate in any key, UTF-16 order (the
 * default sort's) is code-point order, and it needs no copy of each key per comparison.
 */
function sortedKeys(value: object): string[] {
  const keys = Object.keys(value);
  return keys.some((key) => SURROGATE.test(key)) ? keys.sort(compareCodePoints) : keys.sort();
}

/** Code-point order, as Python sorts str keys (UTF-16 order differs above the BMP). */
function compareCodePoints(a: string, b: string): number {
  const ai = [...a];
  const bi = [...b];
  for (let i = 0; i < Math.min(ai.length, bi.length); i += 1) {
    const d = ai[i]!.codePointAt(0)! - bi[i]!.codePointAt(0)!;
    if (d !== 0) return d;
  }
  return ai.length - bi.length;
}

/** `json.dumps(value, sort_keys=True, separators=(",", ":"))` with Python's defaults. */
export function canonicalPythonJson(value: JsonValue): string {
  if (value === null) return 'null';
  if (typeof value === 'boolean') return value ? 'true' : 'false';
  if (typeof value === 'bigint') return value.toString();
  if (typeof value === 'number') return pythonNumber(value);
  if (typeof value === 'string') return pythonString(value);
  // Appended in place: no array of parts per object (this runs on every episode's task).
  if (Array.isArray(value)) {
    let out = '[';
    for (let i = 0; i < value.length; i += 1) {
      if (i > 0) out += ',';
      out += canonicalPythonJson(value[i]!);
    }
    return `${out}]`;
  }
  let out = '{';
  for (const key of sortedKeys(value)) {
    if (out.length > 1) out += ',';
    out += `${pythonString(key)}:${canonicalPythonJson(value[key]!)}`;
  }
  return `${out}}`;
}

/** SHA-256 (hex) of the task's canonical JSON: a restored record continues only the same task. */
export function taskDigest(task: JsonObject): string {
  return createHash('sha256').update(canonicalPythonJson(task), 'utf8').digest('hex');
}

// --- the participant -------------------------------------------------------------------------

const RECORD_KEYS = new Set(['episode_id', 'task_digest', 'boundary']);

function unknownRecordKeys(keys: readonly string[]): string[] {
  const extra: string[] = [];
  for (const key of keys) if (!RECORD_KEYS.has(key)) extra.push(key);
  return extra;
}

/**
 * A record under `episode`, built field by field (a spread of thousands costs more). One read back
 * undecoded stays so: its boundary is decoded when first read, and its text is written back as is.
 */
function copyRecord(record: EnvironmentRecord, episode: EpisodeId): EnvironmentRecord {
  const pieces = record[RECORD_FIELDS_JSON];
  if (pieces === undefined) {
    return { episode_id: episode, task_digest: record.task_digest, boundary: record.boundary };
  }
  return {
    episode_id: episode,
    task_digest: record.task_digest,
    get boundary(): Boundary | null {
      return record.boundary;
    },
    [RECORD_FIELDS_JSON]: pieces,
  };
}

/**
 * The problems of a record's fields but its episode's. `boundary` is the record's (undefined when
 * it has none), or `DEFERRED`: present, and checked when first read.
 */
function recordProblems(keys: readonly string[], taskDigest: unknown, boundary: unknown): string[] {
  const problems: string[] = [];
  const extra = unknownRecordKeys(keys);
  if (extra.length > 0) problems.push(`unknown keys ${extra.join(', ')}`);
  if (typeof taskDigest !== 'string' || !SHA256_HEX.test(taskDigest)) {
    problems.push('task_digest must be a sha256 hex digest');
  }
  if (boundary !== DEFERRED && !isBoundary(boundary)) {
    problems.push('boundary must be an object or null');
  }
  return problems;
}

const DEFERRED = Symbol('checked when first read');

function isBoundary(value: unknown): value is Boundary | null {
  return value === null || (typeof value === 'object' && !Array.isArray(value));
}

/** A restored record whose boundary is decoded (and checked) when its replacement first runs. */
function undecodedRecord(record: RawRecord, key: string, taskDigest: string): EnvironmentRecord {
  let boundary: Boundary | null | undefined;
  return {
    episode_id: record.episode_id,
    task_digest: taskDigest,
    get boundary(): Boundary | null {
      if (boundary !== undefined) return boundary;
      const value = record.field('boundary');
      if (!isBoundary(value)) {
        throw new CheckpointStateError(
          `environment record ${key}: boundary must be an object or null`,
        );
      }
      return (boundary = value);
    },
    // A digest is hex: its JSON string needs no escaping.
    [RECORD_FIELDS_JSON]: [
      `"task_digest":"${taskDigest}","boundary":`,
      record.fieldBytes('boundary')!,
    ],
  };
}

export interface EpisodeRunOptions {
  deadlineSeconds?: number | null;
  /** The protocol records no boundaries: the episode is a restart from the start. */
  restart?: boolean;
}

const SHA256_HEX = /^[0-9a-f]{64}$/;

export class EnvironmentParticipant extends BaseParticipant<EnvironmentRecord> {
  readonly steps: EpisodeSteps;
  /** Unclaimed restored episodes by replacement capture key; records name the replacement. */
  private readonly restored = new Map<string, EnvironmentRecord>();
  /** Live episodes' task digests (with their attempt, so an export parses no capture key). */
  private readonly digests = new Map<string, { episode: EpisodeId; digest: string }>();
  /** Set by a restore: replacements wait for the controller's resume. */
  private awaitingResume = false;
  private carriedRestarts: ReadonlySet<string> = new Set();
  /** Tracked keys (live or restored) by rollout id: a retire looks up its rollout's keys only. */
  private readonly keysByRollout = new Map<string, Set<string>>();
  /**
   * On a worker of a server with several workers: the restored records its coordinator holds. A
   * replacement claims its record there before it runs (`ParticipantWorker`).
   */
  claims: RestoredClaims<EnvironmentRecord> | undefined;

  constructor(instance: string) {
    super('environment', instance);
    this.steps = new EpisodeSteps({
      onChange: () => this.notifyChange(),
      onForget: (key) => this.untrack(key),
      // An episode's replay steps (a seed, an agent's turn) mostly end before any checkpoint.
      encodeAheadSettleMs: ENCODE_AHEAD_SETTLE_MS,
    });
  }

  /** `key` is `rolloutId`'s episode's capture key: callers have both, parsing it back costs. */
  private track(key: string, rolloutId: string): void {
    let keys = this.keysByRollout.get(rolloutId);
    if (keys === undefined) {
      keys = new Set();
      this.keysByRollout.set(rolloutId, keys);
    }
    keys.add(key);
  }

  /** Drops `key` from the index once neither the steps nor the restored records hold it. */
  private untrack(key: string): void {
    if (this.steps.has(key) || this.restored.has(key)) return;
    const { rollout_id } = parseCaptureKey(key);
    const keys = this.keysByRollout.get(rollout_id);
    keys?.delete(key);
    if (keys?.size === 0) this.keysByRollout.delete(rollout_id);
  }

  private deleteRestoredRecord(key: string): void {
    this.restored.delete(key);
    this.untrack(key);
  }

  /**
   * Begins the episode and runs `work` under its steps, once the environment rule
   * (`episodeRunAdmission`) admits it: a retired attempt, admission closed for anything but a
   * replacement after the post-restore resume, a restored record for another task, or an attempt
   * already running is refused, in that order. A refused request owns nothing.
   */
  run<T>(
    episode: EpisodeId,
    task: JsonObject,
    options: EpisodeRunOptions,
    work: (ep: EpisodeContext) => Promise<T>,
  ): Promise<T> {
    const key = captureKey(episode);
    if (this.claims?.holds(key)) return this.claimThenRun(episode, key, task, options, work);
    return this.runHere(episode, key, task, options, work);
  }

  /** `run` once any restored record of the episode is this process's. */
  private runHere<T>(
    episode: EpisodeId,
    key: string,
    task: JsonObject,
    options: EpisodeRunOptions,
    work: (ep: EpisodeContext) => Promise<T>,
  ): Promise<T> {
    const digest = taskDigest(task);
    const restored = this.restored.get(key);
    const refusal = episodeRunAdmission({
      episode,
      key,
      open: !this.steps.closed,
      retired: this.marks.isRetired(episode),
      restored: restored && { sameTask: restored.task_digest === digest },
      awaitingResume: this.awaitingResume,
      running: this.steps.has(key),
    });
    if (refusal) return Promise.reject(refusal);
    let continuation: Boundary | null;
    try {
      continuation = restored?.boundary ?? null; // a restored boundary is decoded here
    } catch (err) {
      return Promise.reject(err as Error);
    }
    this.track(key, episode.rollout_id);
    return this.steps.run(
      key,
      {
        continuation,
        deadlineSeconds: options.deadlineSeconds ?? null,
        restart: options.restart ?? false,
      },
      async (ep) => {
        // Claimed only now: the restored record stays until a replacement actually starts.
        this.deleteRestoredRecord(key);
        this.digests.set(key, { episode: episodeIdToJson(episode), digest });
        try {
          return await work(ep);
        } finally {
          this.digests.delete(key);
        }
      },
    );
  }

  /**
   * A replacement whose restored record its worker's coordinator holds: refused as any request is
   * for a retired or running attempt before it claims (a refused request claims nothing), then it
   * claims the record and runs with it. Another worker's claim won: the attempt runs there, and
   * this one is refused as a second request for a running attempt is in one process.
   */
  private async claimThenRun<T>(
    episode: EpisodeId,
    key: string,
    task: JsonObject,
    options: EpisodeRunOptions,
    work: (ep: EpisodeContext) => Promise<T>,
  ): Promise<T> {
    const refusal = episodeRunAdmission({
      episode,
      key,
      open: true,
      retired: this.marks.isRetired(episode),
      restored: undefined,
      awaitingResume: false,
      running: this.steps.has(key),
    });
    if (refusal) throw refusal;
    const record = await this.claims!.claim(key);
    if (record === null) {
      throw new CheckpointError(
        `episode ${key} is already running: another worker claimed its restored record`,
      );
    }
    this.holdRestored(record);
    return this.runHere(episode, key, task, options, work);
  }

  closeAdmission(request: AdmissionRequest): Promise<void> {
    this.carriedRestarts = request.carriedRestarts;
    this.steps.close();
    return Promise.resolve();
  }

  openAdmission(): Promise<void> {
    this.awaitingResume = false;
    this.carriedRestarts = new Set();
    this.steps.open();
    return Promise.resolve();
  }

  ready(): boolean {
    return this.steps.blockerCount() === 0;
  }

  readiness(): PrepareReport {
    return prepareReport({
      blockers: this.steps.blockers(),
      blockerCount: this.steps.blockerCount(),
      counts: { episodes: this.steps.size },
      restarts: this.steps.restarts(),
    });
  }

  /** Live parked or replay-step episodes in scope, plus unclaimed restored episodes in scope. */
  export(scope: readonly EpisodeId[] | null): Promise<EnvironmentRecord[]> {
    const inScope = scope === null ? null : new Set(scope.map(captureKey));
    const records: EnvironmentRecord[] = [];
    for (const [key, boundary] of this.steps.exported()) {
      if (inScope !== null && !inScope.has(key)) continue;
      if (this.carriedRestarts.has(key)) continue;
      const live = this.digests.get(key);
      if (live === undefined) continue;
      const record: EnvironmentRecord = {
        episode_id: live.episode,
        task_digest: live.digest,
        boundary,
      };
      const json = this.boundaryJson(key);
      // A digest is hex: its JSON string needs no escaping.
      if (json !== undefined)
        record[RECORD_FIELDS_JSON] = [`"task_digest":"${live.digest}","boundary":`, json];
      records.push(record);
    }
    for (const [key, record] of this.restored) {
      if (inScope === null || inScope.has(key)) records.push(copyRecord(record, record.episode_id));
    }
    return Promise.resolve(records);
  }

  /** The boundary's JSON, mostly encoded ahead; none when it is not JSON (the store says so). */
  private boundaryJson(key: string): string | undefined {
    try {
      return this.steps.boundaryJson(key);
    } catch {
      return undefined;
    }
  }

  validateRecord(record: JsonObject, key: string): EnvironmentRecord {
    const { episode_id, task_digest, boundary } = record;
    const problems = recordProblems(Object.keys(record), task_digest, boundary);
    let episode: EpisodeId | undefined;
    try {
      episode = episodeIdFromJson(episode_id);
    } catch (err) {
      problems.push((err as Error).message);
    }
    if (problems.length > 0 || episode === undefined) {
      throw new CheckpointStateError(`environment record ${key}: ${problems.join('; ')}`);
    }
    return {
      episode_id: episode,
      task_digest: task_digest as string,
      boundary: (boundary ?? null) as Boundary | null,
    };
  }

  /** Checks the keys and the task digest now; the boundary waits for the replacement's `/run`. */
  validateRawRecord(record: RawRecord, key: string): EnvironmentRecord {
    if (record.bytes.length < DEFER_DECODE_MIN_BYTES)
      return this.validateRecord(record.decode(), key);
    const taskDigest = record.field('task_digest');
    const names = record.fieldNames();
    const problems = recordProblems(
      names,
      taskDigest,
      names.includes('boundary') ? DEFERRED : undefined,
    );
    if (problems.length > 0) {
      throw new CheckpointStateError(`environment record ${key}: ${problems.join('; ')}`);
    }
    return undecodedRecord(record, key, taskDigest as string);
  }

  override checkRestore(): void {
    if (this.steps.size > 0 || this.restored.size > 0) {
      throw new CheckpointError('environment restore requires a process without live episodes');
    }
  }

  install(records: EnvironmentRecord[]): Promise<void> {
    this.checkRestore();
    for (const record of records) this.holdRestored(record);
    this.awaitingResume = true;
    return Promise.resolve();
  }

  /** Keeps a restored record (naming the attempt it replaces) under its replacement attempt. */
  private holdRestored(record: EnvironmentRecord): void {
    const replacement = nextAttempt(record.episode_id);
    const key = captureKey(replacement);
    this.restored.set(key, copyRecord(record, replacement));
    this.track(key, replacement.rollout_id);
  }

  restoredPending(): EpisodeId[] {
    return [...this.restored.values()].map((r) => r.episode_id);
  }

  /** Frees the restored record only: the controller may still start that attempt over. */
  override deleteRestored(episode: EpisodeId): Promise<void> {
    this.deleteRestoredRecord(captureKey(episode));
    return Promise.resolve();
  }

  /** Stops every covered live attempt and waits for it to end (cleanup included); frees records. */
  async retire(episode: EpisodeId): Promise<void> {
    const live = this.coveredKeys(episode).filter((key) => this.steps.has(key));
    await Promise.all(live.map((key) => this.steps.retire(key)));
    for (const key of this.coveredKeys(episode)) this.deleteRestoredRecord(key);
  }

  /**
   * Tracked keys (live or restored) of the attempts `episode` covers, from its rollout's own keys:
   * a controller retires thousands of rollouts one by one, and an attempt number sizes nothing.
   */
  private coveredKeys(episode: EpisodeId): string[] {
    const keys = this.keysByRollout.get(episode.rollout_id) ?? [];
    return [...keys].filter((key) => covers(episode, parseCaptureKey(key)));
  }

  /** A rollout whose retired attempt is still running (a retire cut short) keeps its mark. */
  override checkForget(rolloutIds: readonly string[]): void {
    const ids = new Set(rolloutIds);
    for (const key of this.steps.keys()) {
      if (!this.steps.state(key)?.retired) continue;
      const episode = parseCaptureKey(key);
      if (ids.has(episode.rollout_id)) {
        throw new RetireIncompleteError(
          `rollout '${episode.rollout_id}' still has a retired episode running (${key}); retire again first`,
        );
      }
    }
  }

  /**
   * `episodes` (every live capture key, restarts included) and `restored_pending` (unclaimed
   * restored episodes by their replacement attempt): what a controller commits when it continues
   * everything in flight (the coordinator CLI's `checkpoint`).
   */
  override statusExtra(): Record<string, unknown> {
    return {
      episodes: [...this.steps.keys()].sort(),
      restored_pending: [...this.restored.keys()].sort(),
    };
  }
}
