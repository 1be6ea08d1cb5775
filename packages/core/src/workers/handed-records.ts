/**
 * Records between a coordinator and its workers as bytes beside a small index, both ways.
 *
 * - Export (a worker's answer to the commit's `export`): each record's fields after `episode_id`
 *   encoded once, in the worker, into one buffer, as the store writes them; per record the index
 *   holds its `episode_id`, the few fields its coordinator reads
 *   (`CoordinatedRecords.exportedFields`) and its bytes' length. The coordinator builds each record
 *   from its index entry and a view of the bytes (`RECORD_FIELDS_JSON`), decoding none: the worker
 *   runs the same code, so what it exports needs no second check.
 * - Install (the coordinator's message to each worker at a restore): each record's whole line as
 *   the store read it (a record the coordinator only has decoded is encoded as the store would
 *   write it); the worker reads each line as the store reads one (`RawRecord`), so a session's
 *   state is decoded where it is used, once, and nowhere on the way.
 */
import { CheckpointError, CheckpointStateError } from '../errors.js';
import { captureKey, type EpisodeId, episodeIdFromJson, episodeIdToJson } from '../identity.js';
import { encodeJsonBytes } from '../json-pieces.js';
import { encodeJson, JsonEncodeError, type JsonObject, type JsonValue } from '../json.js';
import { type CheckpointRecord, RECORD_FIELDS_JSON } from '../store.js';

type Pieces = readonly (string | Uint8Array)[];

/** One record of the index: its `episode_id` and the fields asked for, and its bytes' length. */
export interface HandedRecord {
  readonly head: JsonObject;
  readonly length: number;
}

/** The records as the index and their fields' JSON, one record after another. */
export function handRecords(
  records: readonly CheckpointRecord[],
  fields: readonly string[],
): { index: HandedRecord[]; bytes: Buffer } {
  const { lengths, bytes } = joined(records.map(fieldsJson));
  const index = records.map((record, i) => ({ head: headOf(record, fields), length: lengths[i]! }));
  return { index, bytes };
}

/** Each record's pieces one after another in one buffer, and each record's byte length. */
function joined(records: readonly Pieces[]): { lengths: number[]; bytes: Buffer } {
  const lengths = records.map(byteLength);
  const bytes = Buffer.allocUnsafe(lengths.reduce((total, length) => total + length, 0));
  let at = 0;
  for (const pieces of records) at = writePieces(pieces, bytes, at);
  return { lengths, bytes };
}

/**
 * The text the store writes after a record's `episode_id`: the pieces the participant encoded
 * ahead (`RECORD_FIELDS_JSON`), else the record's other fields encoded now (kept pieces inside,
 * `encodeOnce` and `appendEncoded`, are reused), refused as the store refuses them.
 */
function fieldsJson(record: CheckpointRecord): Pieces {
  const kept = record[RECORD_FIELDS_JSON];
  if (kept !== undefined) return kept;
  const { episode_id: _episode, ...fields } = record;
  try {
    return withoutBraces(encodeJsonBytes(fields));
  } catch (err) {
    if (!(err instanceof JsonEncodeError)) throw err;
    throw new CheckpointStateError(
      `checkpoint record of episode '${captureKey(record.episode_id)}' is not JSON: ${err.message}`,
      { cause: err },
    );
  }
}

/** An object's pieces without its braces (an object's pieces open and close with text). */
function withoutBraces(pieces: (string | Uint8Array)[]): Pieces {
  pieces[0] = (pieces[0] as string).slice(1);
  pieces[pieces.length - 1] = (pieces.at(-1) as string).slice(0, -1);
  return pieces.filter((piece) => piece.length > 0);
}

function headOf(record: CheckpointRecord, fields: readonly string[]): JsonObject {
  const head: JsonObject = { episode_id: episodeIdToJson(record.episode_id) as JsonValue };
  for (const field of fields) {
    if (record[field] !== undefined) head[field] = record[field] as JsonValue;
  }
  return head;
}

function byteLength(pieces: Pieces): number {
  let length = 0;
  for (const piece of pieces) {
    length += typeof piece === 'string' ? Buffer.byteLength(piece) : piece.length;
  }
  return length;
}

function writePieces(pieces: Pieces, into: Buffer, at: number): number {
  let end = at;
  for (const piece of pieces) {
    if (typeof piece === 'string') {
      end += into.write(piece, end);
    } else {
      into.set(piece, end);
      end += piece.length;
    }
  }
  return end;
}

/**
 * The records a worker handed, each its head and a view of its bytes (which the store writes as
 * they are). An index that does not cover the bytes exactly fails the export.
 */
export function handedRecords(
  index: readonly HandedRecord[],
  bytes: Uint8Array,
): CheckpointRecord[] {
  const records: CheckpointRecord[] = [];
  let at = 0;
  for (const { head, length } of index) {
    if (!Number.isSafeInteger(length) || length < 0 || at + length > bytes.length) break;
    const pieces = length === 0 ? [] : [bytes.subarray(at, at + length)];
    records.push({
      ...head,
      episode_id: episodeIdFromJson(head.episode_id),
      [RECORD_FIELDS_JSON]: pieces,
    });
    at += length;
  }
  if (records.length !== index.length || at !== bytes.length) {
    throw new CheckpointError("a worker's exported records do not match their bytes");
  }
  return records;
}

/** A record line the coordinator hands a worker to install, with its episode. */
export interface InstalledLine {
  readonly episode: EpisodeId;
  readonly line: Buffer;
}

/**
 * The records as lines for a worker's install: `lineOf` gives a record's line as the store read it;
 * a record without one is encoded as the store writes it.
 */
export function handLines(
  records: readonly CheckpointRecord[],
  lineOf: (record: CheckpointRecord) => Uint8Array | undefined,
): { index: HandedRecord[]; bytes: Buffer } {
  const { lengths, bytes } = joined(
    records.map((record): Pieces => {
      const line = lineOf(record);
      return line === undefined ? encodedLine(record) : [line];
    }),
  );
  const index = records.map((record, i) => ({
    head: { episode_id: episodeIdToJson(record.episode_id) as JsonValue },
    length: lengths[i]!,
  }));
  return { index, bytes };
}

/** `{"episode_id":…,` then the record's other fields, as the store writes its line. */
function encodedLine(record: CheckpointRecord): Pieces {
  const fields = fieldsJson(record);
  const episode = `{"episode_id":${encodeJson(episodeIdToJson(record.episode_id))}`;
  return [episode, ...(fields.length > 0 ? [','] : []), ...fields, '}'];
}

/**
 * The lines a coordinator handed, each with its episode and a copy of its bytes (as the store's
 * raw read copies each line): a session kept undecoded holds its own line, not the whole message.
 * An index that does not cover the bytes exactly fails the install.
 */
export function handedLines(index: readonly HandedRecord[], bytes: Uint8Array): InstalledLine[] {
  const whole = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const lines: InstalledLine[] = [];
  let at = 0;
  for (const { head, length } of index) {
    if (!Number.isSafeInteger(length) || length < 0 || at + length > whole.length) break;
    lines.push({
      episode: episodeIdFromJson(head.episode_id),
      line: Buffer.from(whole.subarray(at, at + length)),
    });
    at += length;
  }
  if (lines.length !== index.length || at !== whole.length) {
    throw new CheckpointError("the coordinator's records to install do not match their bytes");
  }
  return lines;
}
