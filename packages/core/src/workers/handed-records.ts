/**
 * A worker's exported records as bytes (its answer to the commit's `export`): each record's fields
 * after `episode_id` encoded once, in the worker, into one buffer, as the store writes them, and a
 * small index: per record its `episode_id`, the few fields its coordinator reads
 * (`CoordinatedRecords.exportedFields`) and its bytes' length. The coordinator builds each record
 * from its index entry and a view of the bytes (`RECORD_FIELDS_JSON`), decoding none: the worker
 * runs the same code, so what it exports needs no second check.
 */
import { CheckpointError, CheckpointStateError } from '../errors.js';
import { captureKey, episodeIdFromJson, episodeIdToJson } from '../identity.js';
import { encodeJsonBytes } from '../json-pieces.js';
import { JsonEncodeError, type JsonObject, type JsonValue } from '../json.js';
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
  const encoded = records.map(fieldsJson);
  const index = records.map((record, i) => ({
    head: headOf(record, fields),
    length: byteLength(encoded[i]!),
  }));
  const bytes = Buffer.allocUnsafe(index.reduce((total, r) => total + r.length, 0));
  let at = 0;
  for (const pieces of encoded) at = writePieces(pieces, bytes, at);
  return { index, bytes };
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
