/**
 * Frames on a worker channel: a 4-byte big-endian length, then that many bytes of UTF-8 JSON
 * written by core's faithful codec, as the checkpoint writer writes records — so NaN, ±Infinity
 * (a `-Infinity` logprob) and integers beyond 2^53 reach the other process unchanged.
 *
 * A frame may carry raw bytes beside its JSON (`WithBytes`): the top bit of its length prefix is
 * set, and its content is a 4-byte big-endian length of the JSON, the JSON, then the bytes. The
 * bytes are neither encoded nor decoded (a policy worker's ledger lines reach the coordinator as
 * they are), and the reader hands them over as a view of the frame, not a copy.
 */
import { decodeJson, encodeJson, type JsonValue } from '../json.js';

/**
 * Commit and restore carry a worker's records in one message (hundreds of MB for large sessions);
 * the limit only rejects a corrupt length prefix.
 */
export const MAX_FRAME_BYTES = 1024 * 1024 * 1024;
const PREFIX_BYTES = 4;
/** Set in the length prefix of a frame that carries bytes beside its JSON. */
const WITH_BYTES_FLAG = 0x8000_0000;

/** A message with raw bytes beside it: its JSON `body` and `bytes` that travel unencoded. */
export class WithBytes {
  constructor(
    readonly body: JsonValue,
    readonly bytes: Uint8Array,
  ) {}
}

/** A frame that cannot be written or read: too long, or its bytes are not JSON. */
export class FrameError extends Error {
  override readonly name = 'FrameError';
}

/**
 * One message as a frame, with `bytes` beside it if given; throws `FrameError` (too long) or the
 * codec's `JsonEncodeError`.
 */
export function encodeFrame(
  message: unknown,
  maxBytes = MAX_FRAME_BYTES,
  bytes?: Uint8Array,
): Buffer {
  return Buffer.concat(framePieces(message, maxBytes, bytes));
}

/**
 * `encodeFrame`'s frame as the pieces it is made of, for one gathered write: `bytes` (a worker's
 * ledger lines, MBs at a large commit) are not copied into a fresh frame.
 */
export function framePieces(
  message: unknown,
  maxBytes = MAX_FRAME_BYTES,
  bytes?: Uint8Array,
): Uint8Array[] {
  const data = Buffer.from(encodeJson(message), 'utf8');
  const size = bytes === undefined ? data.length : PREFIX_BYTES + data.length + bytes.length;
  if (size > maxBytes) {
    throw new FrameError(`a message of ${size} bytes exceeds the frame limit of ${maxBytes}`);
  }
  if (bytes === undefined) {
    const prefix = Buffer.allocUnsafe(PREFIX_BYTES);
    prefix.writeUInt32BE(data.length, 0);
    return [prefix, data];
  }
  const prefixes = Buffer.allocUnsafe(2 * PREFIX_BYTES);
  prefixes.writeUInt32BE((size | WITH_BYTES_FLAG) >>> 0, 0);
  prefixes.writeUInt32BE(data.length, PREFIX_BYTES);
  return bytes.length === 0 ? [prefixes, data] : [prefixes, data, bytes];
}

/** Reads frames out of a byte stream, chunk by chunk. */
export class FrameReader {
  readonly #maxBytes: number;
  #chunks: Buffer[] = [];
  #buffered = 0;

  constructor(maxBytes = MAX_FRAME_BYTES) {
    this.#maxBytes = maxBytes;
  }

  /**
   * Adds a chunk; returns the messages it completed (a frame carrying bytes as `WithBytes`).
   * Throws `FrameError` on a corrupt frame.
   */
  push(chunk: Buffer): (JsonValue | WithBytes)[] {
    this.#chunks.push(chunk);
    this.#buffered += chunk.length;
    const messages: (JsonValue | WithBytes)[] = [];
    for (;;) {
      if (this.#buffered < PREFIX_BYTES) return messages;
      const prefix = this.#peekSize();
      const withBytes = prefix >= WITH_BYTES_FLAG;
      const size = withBytes ? prefix - WITH_BYTES_FLAG : prefix;
      if (size > this.#maxBytes) {
        throw new FrameError(`a frame of ${size} bytes exceeds the limit of ${this.#maxBytes}`);
      }
      if (this.#buffered < PREFIX_BYTES + size) return messages;
      const frame = this.#take(PREFIX_BYTES + size).subarray(PREFIX_BYTES);
      messages.push(withBytes ? this.#decodeWithBytes(frame) : this.#decode(frame));
    }
  }

  #peekSize(): number {
    const head = this.#chunks[0]!;
    if (head.length >= PREFIX_BYTES) return head.readUInt32BE(0);
    const joined = Buffer.concat(this.#chunks);
    this.#chunks = [joined];
    return joined.readUInt32BE(0);
  }

  #take(bytes: number): Buffer {
    const joined = this.#chunks.length === 1 ? this.#chunks[0]! : Buffer.concat(this.#chunks);
    const rest = joined.subarray(bytes);
    this.#chunks = rest.length > 0 ? [rest] : [];
    this.#buffered = rest.length;
    return joined.subarray(0, bytes);
  }

  /** A frame's JSON and the bytes after it; a JSON length the frame cannot hold is corrupt. */
  #decodeWithBytes(frame: Buffer): WithBytes {
    const jsonLength = frame.length >= PREFIX_BYTES ? frame.readUInt32BE(0) : undefined;
    if (jsonLength === undefined || PREFIX_BYTES + jsonLength > frame.length) {
      throw new FrameError(
        `a frame of ${frame.length} bytes cannot hold the JSON length it declares (${jsonLength ?? 'none'})`,
      );
    }
    const json = frame.subarray(PREFIX_BYTES, PREFIX_BYTES + jsonLength);
    return new WithBytes(this.#decode(json), frame.subarray(PREFIX_BYTES + jsonLength));
  }

  #decode(frame: Buffer): JsonValue {
    try {
      return decodeJson(frame.toString('utf8'));
    } catch (err) {
      throw new FrameError(`a frame is not JSON: ${(err as Error).message}`);
    }
  }
}
