/**
 * The record store: each participant's checkpoint state is one records file and one manifest in
 * `<checkpoint_dir>/gym/<kind>/<instance>/`. The records file (`records-<sha256>.jsonl`) holds one
 * JSON object per line, `episode_id` first; the manifest is created last, exactly once, and names
 * the records file with its digest and line count, so a directory that holds a manifest never
 * changes. Writing and reading both stream: one record at a time, never the whole file in memory.
 * Every failure is a typed `invalid_checkpoint_state` (422) naming the file or the episode.
 *
 * A checkpoint directory is untrusted input. A restore reads only regular files, opened without
 * following a symlink, from a participant directory whose real path is `<real checkpoint_dir>/gym/
 * <kind>/<instance>`: `checkpoint_dir` itself may be a symlink, nothing below it may. It reads at
 * most the bytes the manifest declares (`records_bytes`; a manifest without it, as Python writes,
 * is bounded by the file's size), never more than MAX_RECORDS_BYTES, holding two read chunks and
 * one line of at most MAX_RECORD_LINE_BYTES beyond the records it keeps. Files are written 0600
 * and the directories the store creates 0700 unless the caller names other modes.
 */
import { isUtf8 } from 'node:buffer';
import { createHash, randomBytes } from 'node:crypto';
import type { FileHandle } from 'node:fs/promises';
import { constants } from 'node:fs';
import { chmod, link, mkdir, open, realpath, rename, unlink } from 'node:fs/promises';
import { join, relative, sep } from 'node:path';

import { CheckpointStateError } from './errors.js';
import { fsyncDirectory, parentsUpTo } from './fsync.js';
import { ThreadedSha256 } from './hash-thread.js';
import { captureKey, episodeIdFromJson, type EpisodeId } from './identity.js';
import {
  decodeJson,
  encodeJson,
  JsonEncodeError,
  type JsonObject,
  type JsonValue,
} from './json.js';
import {
  arrayElements,
  decodeJsonPieces,
  encodeJsonPieces,
  objectMembers,
  objectMembersBefore,
  type TextSink,
} from './json-pieces.js';
import { Mutex } from './mutex.js';
import { signed, verifyManifestMac } from './signing.js';

export const STATE_SCHEMA_VERSION = 1;
export const MANIFEST_FILE = 'manifest.json';
/** Names of kinds and instances: one safe path component each (JS `$` matches only at the end). */
export const SAFE_NAME_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._-]*$/;
/** `records.jsonl` is the legacy name, still accepted on read. */
export const RECORDS_FILE_PATTERN = /^records(-[0-9a-f]{64})?\.jsonl$/;
/** Modes of what a commit writes: as private as the data (NeMo Gym writes its files 0600). */
export const DEFAULT_STATE_FILE_MODE = 0o600;
export const DEFAULT_STATE_DIR_MODE = 0o700;
/** A manifest is a few hundred bytes plus the participant's extras. */
export const MAX_MANIFEST_BYTES = 1 << 20;
/** One record line (a model's rows of a long rollout are a few MB). */
export const MAX_RECORD_LINE_BYTES = 64 << 20;
/** A records file: far beyond any real export, and a bound on what a restore will read. */
export const MAX_RECORDS_BYTES = 64 * 2 ** 30;

/**
 * A record's fields after `episode_id` as JSON text pieces (`"a":1`, `,"b":`, `[2]`), written in
 * order: a participant that encoded what it exports before the commit (a boundary's JSON, taken
 * when the boundary was recorded) spares the commit that work. The pieces must be exactly what
 * `encodeJson` writes for those fields; the record's own fields are then not read by the store.
 * A piece may be that text's UTF-8 bytes (a message encoded once when it was added), which the
 * commit hashes and writes as they are, large ones without a copy: they must not change until
 * the commit resolves.
 */
export const RECORD_FIELDS_JSON: unique symbol = Symbol.for(
  '@ckpt-gym/core/store.recordFieldsJson',
);

/** One episode's state as a participant exports it; `episode_id` is written first. */
export interface CheckpointRecord {
  episode_id: EpisodeId;
  [RECORD_FIELDS_JSON]?: readonly (string | Uint8Array)[];
  [field: string]: unknown;
}

export interface Manifest {
  schema_version: typeof STATE_SCHEMA_VERSION;
  kind: string;
  instance: string;
  checkpoint_id: string;
  records_file: string;
  records_sha256: string;
  record_count: number;
  /** The records file's size; absent in manifests written before it (and by NeMo Gym). */
  records_bytes?: number;
  [extra: string]: unknown;
}

const BASE_MANIFEST_KEYS = [
  'schema_version',
  'kind',
  'instance',
  'checkpoint_id',
  'records_file',
  'records_sha256',
  'record_count',
  'records_bytes',
] as const;

/** `<checkpointDir>/gym/<kind>/<instance>`; a name that is not one safe path component is refused. */
export function participantDir(checkpointDir: string, kind: string, instance: string): string {
  checkSafeName('kind', kind);
  checkSafeName('instance', instance);
  return join(checkpointDir, 'gym', kind, instance);
}

function checkSafeName(what: 'kind' | 'instance', name: string): void {
  if (typeof name !== 'string' || !SAFE_NAME_PATTERN.test(name)) {
    throw new CheckpointStateError(
      `participant ${what} ${JSON.stringify(name)} is not a safe path component`,
    );
  }
}

// --- stopping a write ---------------------------------------------------------------------------

/**
 * Stops a records write (resume takes it). The writer checks it before each record, and its last
 * check, the rename of its records file and the creation of the manifest run under this handle's
 * lock, so once `stop()` resolves no manifest can appear.
 */
export class WriteStop {
  #stopped = false;
  readonly #lock = new Mutex();

  get stopped(): boolean {
    return this.#stopped;
  }

  /** Marks the write stopped, then waits for a publish already under way to finish. */
  async stop(): Promise<void> {
    this.#stopped = true;
    await this.locked(async () => undefined);
  }

  /** Runs `fn` under the publish lock (callers queue in order). */
  locked<T>(fn: () => Promise<T>): Promise<T> {
    return this.#lock.run(fn);
  }
}

// --- writing ------------------------------------------------------------------------------------

export interface WriteParticipantStateOptions {
  checkpointDir: string;
  kind: string;
  instance: string;
  checkpointId: string;
  records: Iterable<CheckpointRecord> | AsyncIterable<CheckpointRecord>;
  /** Participant keys merged into the manifest; they may not override the base keys. */
  manifestExtra?: Record<string, unknown>;
  /** `checkpoint.signing_key`: when set, the manifest carries its MAC (see signing.ts). */
  signingKey?: Uint8Array;
  stop?: WriteStop;
  /** Mode of the records file and the manifest; default DEFAULT_STATE_FILE_MODE. */
  fileMode?: number;
  /** Mode of each directory the write creates; default DEFAULT_STATE_DIR_MODE. */
  dirMode?: number;
  /** Syncs a directory's entries; injectable so a test can fail one (default fsyncDirectory). */
  syncDirectory?: (dir: string) => Promise<void>;
}

/**
 * Streams `records` into `records-<sha256>.jsonl`, then creates `manifest.json` next to it (never
 * replacing one). Everything is fsynced — the records file, the manifest, the participant directory
 * and each parent up to `checkpointDir` — before the manifest's name appears. A directory that
 * already holds the same manifest returns it (an idempotent re-commit); one holding another commit
 * is refused. On any failure nothing of this write is left behind.
 */
export async function writeParticipantState(opts: WriteParticipantStateOptions): Promise<Manifest> {
  const dir = participantDir(opts.checkpointDir, opts.kind, opts.instance);
  const extra = manifestExtra(opts.manifestExtra);
  const stop = opts.stop ?? new WriteStop();
  const fileMode = opts.fileMode ?? DEFAULT_STATE_FILE_MODE;
  const syncDirectory = opts.syncDirectory ?? fsyncDirectory;
  const recordsTemp = join(dir, `.records.jsonl.${randomSuffix()}`);
  const manifestTemp = join(dir, `.manifest.json.${randomSuffix()}`);
  const manifestPath = join(dir, MANIFEST_FILE);
  let recordsPath: string | undefined; // set once our records file carries its final name
  let published = false;
  try {
    await makeDirectories(dir, opts.dirMode ?? DEFAULT_STATE_DIR_MODE);
    // The directories' own names are made durable while the records are written.
    const parentsSynced = Promise.all(parentsUpTo(dir, opts.checkpointDir).map(syncDirectory));
    parentsSynced.catch(() => undefined); // awaited below; an early failure must not go unhandled
    const written = await writeRecordsFile(
      recordsTemp,
      opts.records,
      stop,
      opts.checkpointId,
      fileMode,
    ).finally(() => parentsSynced);
    const manifest = buildManifest(opts, written, extra);
    const manifestText = manifestJson(manifest);
    await writeSynced(manifestTemp, manifestText, fileMode);
    published = await stop.locked(async () => {
      if (stop.stopped) throw stoppedError(opts.checkpointId);
      // Same name means same bytes: replacing is safe.
      await rename(recordsTemp, join(dir, manifest.records_file));
      recordsPath = join(dir, manifest.records_file);
      await syncDirectory(dir);
      return createOnce(manifestTemp, manifestPath);
    });
    if (published) {
      await syncDirectory(dir);
      return manifest;
    }
    const existing = await loadExisting(manifestPath);
    if (existing !== undefined && manifestJson(existing) === manifestText) {
      return existing as Manifest;
    }
    throw new CheckpointStateError(`${manifestPath} already holds a different commit`);
  } catch (err) {
    // A manifest whose name may not be durable is withdrawn with its records: never half a commit.
    if (published) await removeQuietly(manifestPath);
    if (recordsPath !== undefined) await discardUnlessPublished(recordsPath, manifestPath);
    throw asStateError(err, `cannot write checkpoint state under ${dir}`);
  } finally {
    await removeQuietly(recordsTemp);
    await removeQuietly(manifestTemp);
  }
}

/** The manifest of a write: the base keys, then the participant's extras. */
function buildManifest(
  opts: WriteParticipantStateOptions,
  written: { digest: string; count: number; bytes: number },
  extra: JsonObject,
): Manifest {
  const unsigned: Manifest = {
    schema_version: STATE_SCHEMA_VERSION,
    kind: opts.kind,
    instance: opts.instance,
    checkpoint_id: opts.checkpointId,
    records_file: `records-${written.digest}.jsonl`,
    records_sha256: written.digest,
    record_count: written.count,
    records_bytes: written.bytes,
    ...extra,
  };
  return opts.signingKey ? signed(opts.signingKey, unsigned) : unsigned;
}

/**
 * `mkdir -p dir`, giving each directory it creates `mode` whatever the umask (existing ones keep
 * theirs: they may be shared).
 */
async function makeDirectories(dir: string, mode: number): Promise<void> {
  const first = await mkdir(dir, { recursive: true, mode });
  if (first === undefined) return;
  let current = first;
  await chmod(current, mode);
  for (const name of relative(first, dir).split(sep).filter(Boolean)) {
    current = join(current, name);
    await chmod(current, mode);
  }
}

function manifestExtra(extra: Record<string, unknown> | undefined): JsonObject {
  if (extra === undefined) return {};
  const clash = BASE_MANIFEST_KEYS.find((key) => Object.hasOwn(extra, key));
  if (clash !== undefined) {
    throw new CheckpointStateError(`manifest extra key '${clash}' would override a manifest field`);
  }
  try {
    // Round trip through the codec so the manifest we return equals the one a reader loads.
    return decodeJson(encodeJson(extra)) as JsonObject;
  } catch (err) {
    throw new CheckpointStateError(`manifest extra is not JSON: ${describe(err)}`, { cause: err });
  }
}

function stoppedError(checkpointId: string): CheckpointStateError {
  return new CheckpointStateError(
    `checkpoint ${JSON.stringify(checkpointId)} was resumed before its write finished`,
  );
}

/** Writes the records to `path`, fsyncs it, and returns its digest and line count. */
async function writeRecordsFile(
  path: string,
  records: Iterable<CheckpointRecord> | AsyncIterable<CheckpointRecord>,
  stop: WriteStop,
  checkpointId: string,
  mode: number,
): Promise<{ digest: string; count: number; bytes: number }> {
  const handle = await open(path, 'wx', mode);
  try {
    await handle.chmod(mode); // the umask may have narrowed or the caller widened it
    const out = new BatchedFileWriter(handle);
    try {
      let count = 0;
      const put = (record: CheckpointRecord) => {
        if (stop.stopped) throw stoppedError(checkpointId);
        writeRecordLine(record, out);
        count += 1;
      };
      // A plain iterable is walked without an await per record (8k microtask turns at scale).
      if (Symbol.iterator in records) {
        for (const record of records) {
          put(record);
          if (out.mustWait) await out.throttle();
        }
      } else {
        for await (const record of records) {
          put(record);
          if (out.mustWait) await out.throttle();
        }
      }
      const digest = await out.finish();
      await handle.sync();
      return { digest, count, bytes: out.bytesWritten };
    } finally {
      out.discard();
    }
  } finally {
    await handle.close(); // waits for writes still in flight after a failure
  }
}

/**
 * Writes one record line: `{"episode_id":{"rollout_id","attempt"}, ...the other fields in order}`,
 * the same bytes as `encodeJson` of that object, then `\n`.
 */
function writeRecordLine(record: CheckpointRecord, out: BatchedFileWriter): void {
  const encoded = record[RECORD_FIELDS_JSON];
  if (encoded !== undefined) {
    const episode = validEpisode(record.episode_id);
    // A valid rollout id needs no escaping and an attempt is a safe integer.
    out.put(`{"episode_id":{"rollout_id":"${episode.rollout_id}","attempt":${episode.attempt}}`);
    if (encoded.length > 0) out.put(',');
    for (const piece of encoded) {
      if (typeof piece === 'string') out.put(piece);
      else out.putBytes(piece);
    }
    out.put('}\n');
    return;
  }
  const { episode_id, ...fields } = record;
  const episode = validEpisode(episode_id);
  const line = {
    episode_id: { rollout_id: episode.rollout_id, attempt: episode.attempt },
    ...fields,
  };
  try {
    encodeJsonPieces(line, out);
  } catch (err) {
    if (!(err instanceof JsonEncodeError)) throw err;
    throw new CheckpointStateError(
      `checkpoint record of episode '${captureKey(episode)}' is not JSON: ${err.message}`,
      { cause: err },
    );
  }
  out.put('\n');
}

function validEpisode(value: unknown, where = ''): EpisodeId {
  try {
    return episodeIdFromJson(value);
  } catch (err) {
    throw new CheckpointStateError(
      `checkpoint record${where} has no valid episode_id: ${describe(err)}`,
      {
        cause: err,
      },
    );
  }
}

/** Bytes per write. Small on purpose: fresh memory is slow to touch, and few buffers are reused. */
const WRITE_BATCH_BYTES = 1 << 20;
/** Characters joined before one UTF-8 write into the buffer (×3 stays well under a batch). */
const PENDING_CHARS = 1 << 16;
/** Characters below which a buffer's rest is not worth filling with a slice of a longer text. */
const MIN_SLICE_CHARS = 1 << 12;
/** Batches being hashed and written while the next is filled. */
const WRITES_IN_FLIGHT = 3;

/**
 * Appends text and bytes to a file through a few reused buffers: each full buffer is hashed (in
 * the hashing thread) and written positionally while filling continues in the next, so hashing
 * and disk writes overlap encoding, and memory stays at a few buffers whatever the file size.
 */
class BatchedFileWriter implements TextSink {
  readonly #handle: FileHandle;
  readonly #hash = new ThreadedSha256();
  readonly #free: Buffer[] = [];
  readonly #inFlight: Promise<void>[] = [];
  #buffer: Buffer = Buffer.allocUnsafeSlow(WRITE_BATCH_BYTES);
  #used = 0;
  #pending = '';
  #position = 0;
  #failure: unknown;

  constructor(handle: FileHandle) {
    this.#handle = handle;
  }

  /**
   * Appends `text` as UTF-8 (synchronously: full buffers start writing in the background). Small
   * pieces are joined first: one UTF-8 write per ~64K characters, not one per piece, since each
   * write is a call into C++ that costs more than the copy (a checkpoint writes ~10 per record).
   */
  put(text: string): void {
    this.#pending += text;
    if (this.#pending.length >= PENDING_CHARS) this.#flushPending();
  }

  /**
   * Appends bytes already encoded, copied into the buffers (a large piece across several): the
   * copy is what lets another thread hash them, and costs a fifth of hashing them here.
   */
  putBytes(bytes: Uint8Array): void {
    if (this.#pending.length > 0) this.#flushPending();
    for (let start = 0; start < bytes.length;) {
      if (this.#used === this.#buffer.length) this.#submitCurrent();
      const end = Math.min(bytes.length, start + this.#buffer.length - this.#used);
      this.#buffer.set(bytes.subarray(start, end), this.#used);
      this.#used += end - start;
      start = end;
    }
  }

  /** Bytes submitted so far: the file's size once `finish()` resolves. */
  get bytesWritten(): number {
    return this.#position;
  }

  /** True when the caller should `await throttle()` before putting more. */
  get mustWait(): boolean {
    return this.#inFlight.length > WRITES_IN_FLIGHT || this.#failure !== undefined;
  }

  /**
   * Encodes the pending text into the reused buffers, a buffer's worth at a time: a piece larger
   * than a buffer (a pre-encoded session of hundreds of KB) is sliced (O(1) in V8), never copied
   * into a fresh Buffer of its own.
   */
  #flushPending(): void {
    const text = this.#pending;
    this.#pending = '';
    for (let start = 0; start < text.length;) {
      // 3 bytes per UTF-16 unit bounds the UTF-8 size, so text known to fit is never cut.
      const fits = Math.floor((this.#buffer.length - this.#used) / 3);
      if (fits < text.length - start && fits < MIN_SLICE_CHARS) {
        this.#submitCurrent();
        continue;
      }
      let end = Math.min(text.length, start + fits);
      if (end < text.length && isHighSurrogate(text.charCodeAt(end - 1))) end -= 1;
      const slice = start === 0 && end === text.length ? text : text.slice(start, end);
      this.#used += this.#buffer.write(slice, this.#used);
      start = end;
    }
  }

  /** Waits while too many batches are in flight; throws a write's or the hash's failure. */
  async throttle(): Promise<void> {
    while (this.#inFlight.length > WRITES_IN_FLIGHT) await this.#inFlight.shift();
    this.#throwIfFailed();
  }

  /** Writes what is buffered, waits for every write, and returns the hex SHA-256 of all bytes. */
  async finish(): Promise<string> {
    this.#flushPending();
    this.#submitCurrent();
    await Promise.all(this.#inFlight);
    this.#throwIfFailed();
    return this.#hash.digest();
  }

  /** Drops the hash of a write that failed (`finish` drops it itself). */
  discard(): void {
    this.#hash.close();
  }

  /**
   * Hands the current buffer to the hashing thread, then writes it, then reuses it: batches are
   * hashed in order (the thread's queue), one hashed while the one before is written.
   */
  #submitCurrent(): void {
    if (this.#used === 0) return;
    this.#throwIfFailed();
    const bytes = this.#buffer.subarray(0, this.#used);
    this.#buffer = this.#free.pop() ?? Buffer.allocUnsafeSlow(WRITE_BATCH_BYTES);
    this.#used = 0;
    const position = this.#position;
    this.#position += bytes.length;
    // Never rejects: a failure is kept and thrown by the next throttle or finish.
    const done = this.#hash
      .update(bytes)
      .then(async (hashed) => {
        await writeAll(this.#handle, hashed, position);
        this.#free.push(Buffer.from(hashed.buffer));
      })
      .catch((err: unknown) => {
        this.#failure ??= err;
      });
    this.#inFlight.push(done);
  }

  #throwIfFailed(): void {
    if (this.#failure !== undefined) throw this.#failure as Error; // fs rejects with Errors
  }
}

function isHighSurrogate(unit: number): boolean {
  return unit >= 0xd800 && unit <= 0xdbff;
}

async function writeAll(handle: FileHandle, bytes: Uint8Array, position: number): Promise<void> {
  let offset = 0;
  while (offset < bytes.length) {
    const { bytesWritten } = await handle.write(
      bytes,
      offset,
      bytes.length - offset,
      position + offset,
    );
    offset += bytesWritten;
  }
}

async function writeSynced(path: string, text: string, mode: number): Promise<void> {
  const handle = await open(path, 'wx', mode);
  try {
    await handle.chmod(mode);
    await writeAll(handle, Buffer.from(text, 'utf8'), 0);
    await handle.sync();
  } finally {
    await handle.close();
  }
}

/** Hard-links `temp` to `path`: true when created, false when `path` already existed. */
async function createOnce(temp: string, path: string): Promise<boolean> {
  try {
    await link(temp, path);
    return true;
  } catch (err) {
    if (errnoCode(err) === 'EEXIST') return false;
    throw err;
  }
}

/** The manifest at `path` as JSON, or undefined when it is unreadable or not JSON. */
async function loadExisting(path: string): Promise<JsonValue | undefined> {
  try {
    return decodeJson(await readManifestText(path));
  } catch {
    return undefined;
  }
}

/** Deletes our records file unless a published manifest names it (then it is someone's commit). */
async function discardUnlessPublished(recordsPath: string, manifestPath: string): Promise<void> {
  const existing = await loadExisting(manifestPath);
  const named = isJsonObject(existing) ? existing.records_file : undefined;
  if (typeof named === 'string' && join(manifestPath, '..', named) === recordsPath) return;
  await removeQuietly(recordsPath);
}

// --- the manifest's text --------------------------------------------------------------------------

/**
 * The manifest as Python's `json.dumps(sort_keys=True, indent=1)` writes it: one key per line,
 * one-space indent per level, ASCII only, no trailing newline. Also the canonical form two
 * manifests are compared in.
 */
function manifestJson(value: JsonValue | Manifest): string {
  return indented(value as JsonValue, '');
}

function indented(value: JsonValue, indent: string): string {
  if (typeof value === 'string') return asciiJsonString(value);
  if (value === null || typeof value !== 'object') return encodeJson(value);
  const inner = `${indent} `;
  if (Array.isArray(value)) {
    if (value.length === 0) return '[]';
    return `[\n${value.map((item) => inner + indented(item, inner)).join(',\n')}\n${indent}]`;
  }
  const keys = Object.keys(value).sort();
  if (keys.length === 0) return '{}';
  const lines = keys.map(
    (key) => `${inner}${asciiJsonString(key)}: ${indented(value[key] as JsonValue, inner)}`,
  );
  return `{\n${lines.join(',\n')}\n${indent}}`;
}

/** A JSON string with everything outside printable ASCII escaped, as Python's `ensure_ascii`. */
function asciiJsonString(text: string): string {
  return JSON.stringify(text).replace(
    /[\u007f-\uffff]/g,
    (char) => `\\u${char.charCodeAt(0).toString(16).padStart(4, '0')}`,
  );
}

// --- reading --------------------------------------------------------------------------------------

export interface ReadParticipantStateOptions<R> {
  checkpointDir: string;
  kind: string;
  instance: string;
  /** Whether the episode is in the restore's scope; only those records are validated and kept. */
  select: (key: string, episode: EpisodeId) => boolean;
  /** Turns an in-scope record into the participant's type; a throw makes the restore fail. */
  validate: (record: JsonObject, key: string) => R;
  /** `checkpoint.signing_key`: when set, a manifest without a MAC that verifies is refused. */
  signingKey?: Uint8Array;
}

/**
 * Below this size a participant decodes a record read back undecoded at once (`decode()`), as
 * the eager read would: locating fields in JS costs more than the native parse of a small record
 * (on the 2-core machine, 2 KB agent records read and validated 1.85× slower undecoded; 350 KB
 * ones 0.60×). Above it, a payload waits for its first use.
 */
export const DEFER_DECODE_MIN_BYTES = 16 << 10;

/** `readRawParticipantState`'s options: `validate` is given each in-scope record undecoded. */
export interface ReadRawParticipantStateOptions<R> extends Omit<
  ReadParticipantStateOptions<R>,
  'validate'
> {
  validate: (record: RawRecord, key: string) => R;
}

/**
 * A record read back without decoding its payload (`validateRaw`). The file it came from was
 * verified whole (manifest, digest, count, every episode once); a payload that is not JSON is
 * found only by `decode()`, which throws `invalid_checkpoint_state` naming the episode.
 */
export interface RawRecord {
  readonly episode_id: EpisodeId;
  /** The record's line (UTF-8 JSON, `episode_id` first as the store writes it), without `\n`. */
  readonly bytes: Buffer;
  /** The whole record as `validate` would have received it; decoded once. */
  decode(): JsonObject;
  /**
   * One top-level field decoded alone (undefined when the record has none), the others left as
   * bytes: an install can read the small fields it needs now and keep the payload for later.
   */
  field(name: string): JsonValue | undefined;
  /**
   * One top-level field's JSON text as it lies in `bytes` (undefined when the record has none),
   * checked only for its structure: a participant can write an untouched payload back as it is.
   */
  fieldBytes(name: string): Buffer | undefined;
  /**
   * The texts of an array field's elements as they lie in `bytes` (undefined when the record has
   * no such field), checked only for structure; not an array is a typed error naming the episode.
   */
  fieldElements(name: string): Buffer[] | undefined;
  /** The record's top-level keys in the text's order (a repeated key once), nothing decoded. */
  fieldNames(): string[];
  /**
   * The top-level fields ahead of the first one keyed any of `names`, decoded, nothing from it on
   * read (a later duplicate of one of them is not seen): small fields a writer puts ahead of a
   * large payload are read without walking the payload. Undefined when no field has those names.
   */
  fieldsBefore(...names: string[]): JsonObject | undefined;
}

class LazyRecord implements RawRecord {
  #decoded: JsonObject | undefined;
  #members: Map<string, { start: number; end: number }> | undefined;
  readonly #fields = new Map<string, JsonValue>();

  constructor(
    readonly episode_id: EpisodeId,
    readonly bytes: Buffer,
    private readonly key: string,
    decoded: JsonObject | undefined,
  ) {
    this.#decoded = decoded;
  }

  decode(): JsonObject {
    this.#decoded ??= decodeRawRecord(this.bytes, this.key);
    return this.#decoded;
  }

  fieldNames(): string[] {
    this.#members ??= recordMembers(this.bytes, this.key);
    return [...this.#members.keys()];
  }

  fieldsBefore(...names: string[]): JsonObject | undefined {
    const fields: JsonObject = {};
    if (this.#decoded !== undefined) {
      for (const [key, value] of Object.entries(this.#decoded)) {
        if (names.includes(key)) return fields;
        setOwn(fields, key, value);
      }
      return undefined;
    }
    const before = attempt(this.key, () => objectMembersBefore(this.bytes, names));
    if (before === undefined) return undefined;
    for (const { key, start, end } of before) {
      setOwn(
        fields,
        key,
        attempt(this.key, () => decodeJsonPieces(this.bytes, start, end)),
      );
    }
    return fields;
  }

  fieldBytes(name: string): Buffer | undefined {
    this.#members ??= recordMembers(this.bytes, this.key);
    const member = this.#members.get(name);
    return member === undefined ? undefined : this.bytes.subarray(member.start, member.end);
  }

  fieldElements(name: string): Buffer[] | undefined {
    const bytes = this.fieldBytes(name);
    if (bytes === undefined) return undefined;
    const elements = attempt(this.key, () => arrayElements(bytes));
    return elements.map((e) => bytes.subarray(e.start, e.end));
  }

  field(name: string): JsonValue | undefined {
    if (this.#decoded !== undefined) {
      return Object.hasOwn(this.#decoded, name) ? this.#decoded[name] : undefined;
    }
    this.#members ??= recordMembers(this.bytes, this.key);
    const member = this.#members.get(name);
    if (member === undefined) return undefined;
    let value = this.#fields.get(name);
    if (value === undefined) {
      value = attempt(this.key, () => decodeJsonPieces(this.bytes, member.start, member.end));
      this.#fields.set(name, value);
    }
    return value;
  }
}

/** Sets an own field, `__proto__` included (an assignment would set the prototype). */
function setOwn(object: JsonObject, key: string, value: JsonValue): void {
  Object.defineProperty(object, key, {
    value,
    enumerable: true,
    writable: true,
    configurable: true,
  });
}

/**
 * A record line that reached this process whole (a worker's install), read as the store reads an
 * in-scope line: undecoded, its episode as given (the process that read the file checked it).
 */
export function rawRecordOf(episode: EpisodeId, line: Buffer, key: string): RawRecord {
  return new LazyRecord(episode, line, key, undefined);
}

/** Runs a decode of episode `key`'s record; its failure is a typed error naming the episode. */
function attempt<T>(key: string, decode: () => T): T {
  try {
    return decode();
  } catch (err) {
    throw new CheckpointStateError(
      `checkpoint record of episode '${key}' is not JSON: ${describe(err)}`,
      { cause: err },
    );
  }
}

/** Where each top-level field's value lies in a record's bytes (a repeated key: the last). */
function recordMembers(bytes: Buffer, key: string): Map<string, { start: number; end: number }> {
  return attempt(key, () => {
    if (!isUtf8(bytes)) throw new Error('it is not UTF-8');
    return new Map(objectMembers(bytes).map((m) => [m.key, { start: m.start, end: m.end }]));
  });
}

function decodeRawRecord(bytes: Buffer, key: string): JsonObject {
  const value = attempt(key, () => {
    if (!isUtf8(bytes)) throw new Error('it is not UTF-8');
    return decodeJsonPieces(bytes);
  });
  if (!isJsonObject(value)) {
    throw new CheckpointStateError(`checkpoint record of episode '${key}' is not a JSON object`);
  }
  return value;
}

/**
 * Reads a participant's state in one streaming pass: checks the manifest, then hashes and counts
 * the whole records file while decoding and validating only the records in scope. Per-line
 * problems are reported before a digest or count mismatch, as the file is read.
 */
export function readParticipantState<R>(
  opts: ReadParticipantStateOptions<R>,
): Promise<{ manifest: Manifest; records: R[] }> {
  return readState(opts, true, (_line, record, _episode, key) =>
    opts.validate(record as JsonObject, key),
  );
}

/**
 * `readParticipantState` that decodes on use: everything the restore protocol checks is verified
 * before it resolves (manifest, digest, record count, every record's episode once, the scope), as
 * there, but an in-scope record whose line starts with its episode (as this store and Python write
 * it) is not decoded: `validate` gets it as a `RawRecord`, whose `decode()` decodes it then.
 */
export function readRawParticipantState<R>(
  opts: ReadRawParticipantStateOptions<R>,
): Promise<{ manifest: Manifest; records: R[] }> {
  return readState(opts, false, (line, record, episode, key) => {
    // Copied out: the read buffers are reused for the next chunks.
    const bytes = Buffer.from(line.bytes.subarray(line.start, line.end));
    return opts.validate(new LazyRecord(episode, bytes, key, record), key);
  });
}

/**
 * Turns an in-scope line into a record; `record` is the line decoded (always when the read decodes
 * every in-scope record, else only when finding its episode took it).
 */
type TakeRecord<R> = (
  line: Line,
  record: JsonObject | undefined,
  episode: EpisodeId,
  key: string,
) => R;

async function readState<R>(
  opts: Omit<ReadParticipantStateOptions<R>, 'validate'>,
  decodeInScope: boolean,
  take: TakeRecord<R>,
): Promise<{ manifest: Manifest; records: R[] }> {
  const dir = participantDir(opts.checkpointDir, opts.kind, opts.instance);
  const manifestPath = join(dir, MANIFEST_FILE);
  try {
    await checkNoSymlinkBelow(opts.checkpointDir, dir, manifestPath);
    const manifest = validManifest(
      await readManifestText(manifestPath),
      manifestPath,
      opts.kind,
      opts.instance,
    );
    if (opts.signingKey) verifyManifestMac(opts.signingKey, manifest, manifestPath);
    const recordsPath = join(dir, manifest.records_file);
    const records: R[] = [];
    const lineOf = new Map<string, number>(); // every episode's line: one record per episode
    const { digest, count } = await scanRecordsFile(recordsPath, manifest, (line) => {
      const record = readRecord(line, recordsPath, lineOf, opts.select, {
        decodeInScope,
        take,
      });
      if (record !== SKIPPED) records.push(record);
    });
    if (digest !== manifest.records_sha256) {
      throw new CheckpointStateError(`${recordsPath} does not match its manifest digest`);
    }
    if (count !== manifest.record_count) {
      throw new CheckpointStateError(
        `${recordsPath} expects ${manifest.record_count} records, found ${count}`,
      );
    }
    return { manifest, records };
  } catch (err) {
    throw asStateError(err, `cannot read checkpoint state from ${dir}`);
  }
}

/**
 * The participant directory must be `gym/<kind>/<instance>` of the real checkpoint directory:
 * `checkpoint_dir` may be a symlink (a `latest` link), but a symlinked `gym/`, kind or instance
 * directory would restore another checkpoint's state under this one's name.
 */
async function checkNoSymlinkBelow(
  checkpointDir: string,
  dir: string,
  manifestPath: string,
): Promise<void> {
  let real: string;
  let top: string;
  try {
    [real, top] = await Promise.all([realpath(dir), realpath(checkpointDir)]);
  } catch (err) {
    if (errnoCode(err) === 'ENOENT')
      throw new CheckpointStateError(`missing manifest ${manifestPath}`);
    throw err;
  }
  const expected = join(top, relative(checkpointDir, dir));
  if (real !== expected) {
    throw new CheckpointStateError(
      `${dir} resolves to ${real}: a participant directory must not be reached through a symlink`,
    );
  }
}

/**
 * Opens `path` for reading only if it is a regular file in its directory: never through a
 * symlink, and a FIFO or device is refused without blocking (O_NONBLOCK), checked on the open
 * handle so nothing can swap the file between the check and the read.
 */
async function openRegularFile(path: string): Promise<{ handle: FileHandle; size: number }> {
  let handle: FileHandle;
  try {
    handle = await open(path, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
  } catch (err) {
    if (errnoCode(err) === 'ELOOP') {
      throw new CheckpointStateError(
        `${path} is a symlink: checkpoint files must be regular files in the participant directory`,
      );
    }
    throw err;
  }
  try {
    const stats = await handle.stat();
    if (!stats.isFile()) {
      throw new CheckpointStateError(
        `${path} is not a regular file: checkpoint files must be regular files`,
      );
    }
    return { handle, size: stats.size };
  } catch (err) {
    await handle.close();
    throw err;
  }
}

/** The manifest's text, read from a regular file of at most MAX_MANIFEST_BYTES. */
async function readManifestText(path: string): Promise<string> {
  let opened: { handle: FileHandle; size: number };
  try {
    opened = await openRegularFile(path);
  } catch (err) {
    if (errnoCode(err) === 'ENOENT') throw new CheckpointStateError(`missing manifest ${path}`);
    throw err;
  }
  const { handle, size } = opened;
  try {
    if (size > MAX_MANIFEST_BYTES) {
      throw new CheckpointStateError(
        `${path} is ${size} bytes: a manifest may hold at most ${MAX_MANIFEST_BYTES}`,
      );
    }
    const bytes = Buffer.alloc(size);
    let read = 0;
    while (read < size) {
      const { bytesRead } = await handle.read(bytes, read, size - read, read);
      if (bytesRead === 0) break;
      read += bytesRead;
    }
    return bytes.toString('utf8', 0, read);
  } finally {
    await handle.close();
  }
}

/** The manifest in `text`, checked strictly: one manifest, of this participant, naming its records. */
function validManifest(text: string, path: string, kind: string, instance: string): Manifest {
  let value: JsonValue;
  try {
    value = decodeJson(text);
  } catch (err) {
    throw new CheckpointStateError(`${path} is not JSON: ${describe(err)}`, { cause: err });
  }
  const duplicate = duplicateKey(text);
  if (duplicate !== undefined) {
    throw new CheckpointStateError(
      `${path} gives the key ${JSON.stringify(duplicate)} twice: a manifest's keys must be unique`,
    );
  }
  if (!isJsonObject(value)) throw new CheckpointStateError(`${path} is not a manifest`);
  if (value.schema_version !== STATE_SCHEMA_VERSION) {
    throw new CheckpointStateError(
      `${path} has unsupported schema ${encodeJson(value.schema_version ?? null)}`,
    );
  }
  if (value.kind !== kind || value.instance !== instance) {
    throw new CheckpointStateError(
      `${path} belongs to ${encodeJson(value.kind ?? null)}/${encodeJson(value.instance ?? null)}`,
    );
  }
  if (typeof value.checkpoint_id !== 'string') {
    throw new CheckpointStateError(`${path} names no checkpoint`);
  }
  const recordsFile = value.records_file;
  if (typeof recordsFile !== 'string' || !RECORDS_FILE_PATTERN.test(recordsFile)) {
    throw new CheckpointStateError(
      `${path} names an invalid records file ${encodeJson(recordsFile ?? null)}`,
    );
  }
  if (typeof value.records_sha256 !== 'string') {
    throw new CheckpointStateError(`${path} names no records digest`);
  }
  if (!isCount(value.record_count)) {
    throw new CheckpointStateError(`${path} names no record count`);
  }
  if (value.records_bytes !== undefined && !isCount(value.records_bytes)) {
    throw new CheckpointStateError(`${path} names an invalid records size`);
  }
  return value as Manifest;
}

function isCount(value: JsonValue | undefined): value is number {
  return typeof value === 'number' && Number.isSafeInteger(value) && value >= 0;
}

/**
 * The first key given twice in one object of `text` (valid JSON), compared after unescaping;
 * `JSON.parse` silently keeps the last.
 */
function duplicateKey(text: string): string | undefined {
  const objects: (Set<string> | null)[] = []; // null for an array
  let expectKey = false;
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (c === '{' || c === '[') {
      objects.push(c === '{' ? new Set() : null);
      expectKey = c === '{';
    } else if (c === '}' || c === ']') {
      objects.pop();
      expectKey = false;
    } else if (c === ',') {
      expectKey = objects.at(-1) != null;
    } else if (c === '"') {
      let end = i + 1;
      while (text[end] !== '"') end += text[end] === '\\' ? 2 : 1;
      const keys = objects.at(-1);
      if (expectKey && keys) {
        const key = JSON.parse(text.slice(i, end + 1)) as string;
        if (keys.has(key)) return key;
        keys.add(key);
        expectKey = false;
      }
      i = end;
    }
  }
  return undefined;
}

const SKIPPED = Symbol('out of scope');

/** One line of the records file: its episode for every record, the record taken when in scope. */
function readRecord<R>(
  line: Line,
  recordsPath: string,
  lineOf: Map<string, number>,
  select: (key: string, episode: EpisodeId) => boolean,
  how: { decodeInScope: boolean; take: TakeRecord<R> },
): R | typeof SKIPPED {
  let record: JsonValue | undefined;
  let episodeValue: unknown = episodeFromPrefix(line.bytes, line.start, line.end);
  if (episodeValue === undefined) {
    record = decodeLine(line, recordsPath);
    episodeValue = isJsonObject(record) ? record.episode_id : undefined;
  }
  const episode = validEpisode(episodeValue, ` (line ${line.number} of ${recordsPath})`);
  const key = captureKey(episode);
  const earlier = lineOf.get(key);
  if (earlier !== undefined) {
    throw new CheckpointStateError(
      `${recordsPath} holds episode '${key}' twice (lines ${earlier} and ${line.number}): one record per episode`,
    );
  }
  lineOf.set(key, line.number);
  if (!select(key, episode)) return SKIPPED;
  if (how.decodeInScope) record ??= decodeLine(line, recordsPath);
  try {
    // A record decoded by now is an object: it held a valid episode_id.
    return how.take(line, record as JsonObject | undefined, episode, key);
  } catch (err) {
    throw new CheckpointStateError(
      `checkpoint record of episode '${key}' is invalid: ${describe(err)}`,
      { cause: err },
    );
  }
}

function decodeLine(line: Line, recordsPath: string): JsonValue {
  try {
    if (!isUtf8(line.bytes.subarray(line.start, line.end))) throw new Error('it is not UTF-8');
    return decodeJsonPieces(line.bytes, line.start, line.end);
  } catch (err) {
    throw new CheckpointStateError(
      `${recordsPath} holds a record that is not JSON (line ${line.number}): ${describe(err)}`,
      { cause: err },
    );
  }
}

interface Line {
  readonly bytes: Buffer;
  readonly start: number;
  readonly end: number;
  /** 1-based. */
  readonly number: number;
}

/** Bytes per read; two buffers alternate so the next read runs while a chunk is processed. */
const READ_CHUNK_BYTES = 2 << 20;

/**
 * Opens the records file (a regular file of the size the manifest declares, at most
 * MAX_RECORDS_BYTES) and scans it.
 */
async function scanRecordsFile(
  path: string,
  manifest: Manifest,
  onLine: (line: Line) => void,
): Promise<{ digest: string; count: number }> {
  const { handle, size } = await openRegularFile(path);
  try {
    const declared = manifest.records_bytes;
    if (declared !== undefined && size !== declared) {
      throw new CheckpointStateError(
        `${path} is ${size} bytes, its manifest declares records_bytes ${declared}`,
      );
    }
    if (size > MAX_RECORDS_BYTES) {
      throw new CheckpointStateError(
        `${path} is ${size} bytes: a records file may hold at most ${MAX_RECORDS_BYTES}`,
      );
    }
    return await scanLines(handle, size, path, onLine);
  } finally {
    await handle.close();
  }
}

/**
 * Reads the first `size` bytes of `handle` once in large chunks, calling `onLine` for every
 * `\n`-terminated line (and a last unterminated one), and returns the SHA-256 and line count of
 * those bytes. A line longer than MAX_RECORD_LINE_BYTES is refused as soon as it is.
 */
async function scanLines(
  handle: FileHandle,
  size: number,
  path: string,
  onLine: (line: Line) => void,
): Promise<{ digest: string; count: number }> {
  const hash = createHash('sha256');
  if (size === 0) return { digest: hash.digest('hex'), count: 0 };
  const buffers = [
    Buffer.allocUnsafeSlow(READ_CHUNK_BYTES),
    Buffer.allocUnsafeSlow(READ_CHUNK_BYTES),
  ];
  const read = (index: number, position: number) =>
    handle.read(
      buffers[index % 2] as Buffer,
      0,
      Math.min(READ_CHUNK_BYTES, size - position),
      position,
    );
  let position = 0;
  let next = read(0, position);
  let carry: Buffer[] = []; // a line split across chunks, copied out of the reused buffers
  let carried = 0;
  let count = 0;
  for (let index = 0; position < size; index++) {
    const { bytesRead, buffer } = await next;
    if (bytesRead === 0) {
      throw new CheckpointStateError(`${path} ended after ${position} of its ${size} bytes`);
    }
    position += bytesRead;
    if (position < size) {
      next = read(index + 1, position);
      next.catch(() => undefined); // awaited next round; a failure meanwhile must not go unhandled
    }
    const chunk = buffer.subarray(0, bytesRead);
    hash.update(chunk);
    let start = 0;
    for (let end = chunk.indexOf(0x0a); end !== -1; end = chunk.indexOf(0x0a, start)) {
      count += 1;
      if (carry.length > 0) {
        const joined = Buffer.concat([...carry, chunk.subarray(start, end)]);
        carry = [];
        carried = 0;
        onLine({ bytes: joined, start: 0, end: joined.length, number: count });
      } else {
        onLine({ bytes: chunk, start, end, number: count });
      }
      start = end + 1;
    }
    if (start < bytesRead) {
      carried += bytesRead - start;
      if (carried > MAX_RECORD_LINE_BYTES) {
        throw new CheckpointStateError(
          `${path} line ${count + 1} is longer than ${MAX_RECORD_LINE_BYTES} bytes, the most a record may hold`,
        );
      }
      carry.push(Buffer.from(chunk.subarray(start)));
    }
  }
  if (carry.length > 0) {
    count += 1;
    const last = Buffer.concat(carry);
    onLine({ bytes: last, start: 0, end: last.length, number: count });
  }
  return { digest: hash.digest('hex'), count };
}

// --- the episode of a line without decoding it ------------------------------------------------------

/** Openings of `episode_id` as this store writes it (compact) and as Python's `json.dumps` does. */
const EPISODE_PREFIXES = [
  { open: Buffer.from('{"episode_id":{"rollout_id":"'), attempt: Buffer.from('","attempt":') },
  { open: Buffer.from('{"episode_id": {"rollout_id": "'), attempt: Buffer.from('", "attempt": ') },
];
/** Longest attempt read from a prefix; longer ones take the full decode (and its error). */
const MAX_ATTEMPT_DIGITS = 15;

/**
 * The `episode_id` of a line that starts in one of the known forms, read from its first bytes so
 * an out-of-scope record is never decoded. Undefined when the line starts any other way; the
 * caller then decodes the whole line.
 */
function episodeFromPrefix(
  bytes: Buffer,
  start: number,
  end: number,
): { rollout_id: string; attempt: number } | undefined {
  for (const prefix of EPISODE_PREFIXES) {
    if (!startsWith(bytes, start, end, prefix.open)) continue;
    const idStart = start + prefix.open.length;
    let i = idStart;
    while (i < end && isRolloutIdByte(bytes[i] as number)) i++;
    if (i === idStart || !startsWith(bytes, i, end, prefix.attempt)) return undefined;
    const rolloutId = bytes.toString('latin1', idStart, i);
    const digitsStart = i + prefix.attempt.length;
    i = digitsStart;
    while (i < end && isDigit(bytes[i] as number)) i++;
    const digits = i - digitsStart;
    if (
      digits === 0 ||
      digits > MAX_ATTEMPT_DIGITS ||
      (digits > 1 && bytes[digitsStart] === 0x30)
    ) {
      return undefined;
    }
    // The episode object must close here and the record go on (`,`) or end (`}`).
    if (bytes[i] !== 0x7d || (bytes[i + 1] !== 0x2c && bytes[i + 1] !== 0x7d)) return undefined;
    return { rollout_id: rolloutId, attempt: Number(bytes.toString('latin1', digitsStart, i)) };
  }
  return undefined;
}

/**
 * A byte loop: `Buffer#compare` with ranges validates its arguments in JS on every call, which at
 * two calls per record cost more than reading the rest of the record's episode id.
 */
function startsWith(bytes: Buffer, at: number, end: number, prefix: Buffer): boolean {
  if (end - at < prefix.length) return false;
  for (let i = 0; i < prefix.length; i++) if (bytes[at + i] !== prefix[i]) return false;
  return true;
}

/** `[A-Za-z0-9._-]`: the rollout id alphabet, which never needs a JSON escape. */
function isRolloutIdByte(byte: number): boolean {
  return (
    (byte >= 0x61 && byte <= 0x7a) ||
    (byte >= 0x41 && byte <= 0x5a) ||
    isDigit(byte) ||
    byte === 0x2e ||
    byte === 0x5f ||
    byte === 0x2d
  );
}

function isDigit(byte: number): boolean {
  return byte >= 0x30 && byte <= 0x39;
}

// --- small helpers ----------------------------------------------------------------------------------

function isJsonObject(value: JsonValue | undefined): value is JsonObject {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function randomSuffix(): string {
  return randomBytes(6).toString('hex');
}

/**
 * True for a failed system call (Node's errors with `errno` and `syscall`): an OSError. Checked
 * by shape, since they may come from another realm (a vm context) than this module's `Error`.
 */
function isSystemError(err: unknown): err is NodeJS.ErrnoException {
  const e = err as { errno?: unknown; syscall?: unknown; message?: unknown } | null;
  return (
    typeof e?.errno === 'number' && typeof e.syscall === 'string' && typeof e.message === 'string'
  );
}

function errnoCode(err: unknown): string | undefined {
  const code = (err as { code?: unknown } | null)?.code;
  return typeof code === 'string' ? code : undefined;
}

function describe(err: unknown): string {
  const message = (err as { message?: unknown } | null)?.message;
  return typeof message === 'string' ? message : String(err);
}

/** Typed errors pass through; a filesystem error becomes `invalid_checkpoint_state` with `context`. */
function asStateError(err: unknown, context: string): unknown {
  if (err instanceof CheckpointStateError) return err;
  if (isSystemError(err)) {
    return new CheckpointStateError(`${context}: ${err.message}`, { cause: err });
  }
  return err;
}

/** Best-effort cleanup: it runs on failure paths, where the original error is the one to report. */
async function removeQuietly(path: string): Promise<void> {
  await unlink(path).catch(() => undefined);
}
