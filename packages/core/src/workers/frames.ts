/**
 * Frames on a worker channel: a 4-byte big-endian length, then that many bytes of UTF-8 JSON
 * written by core's faithful codec, as the checkpoint writer writes records — so NaN, ±Infinity
 * (a `-Infinity` logprob) and integers beyond 2^53 reach the other process unchanged.
 */
import { decodeJson, encodeJson, type JsonValue } from '../json.js';

/**
 * Commit and restore carry a worker's records in one message (hundreds of MB for large sessions);
 * the limit only rejects a corrupt length prefix.
 */
export const MAX_FRAME_BYTES = 1024 * 1024 * 1024;
const PREFIX_BYTES = 4;

/** A frame that cannot be written or read: too long, or its bytes are not JSON. */
export class FrameError extends Error {
  override readonly name = 'FrameError';
}

/** One message as a frame; throws `FrameError` (too long) or the codec's `JsonEncodeError`. */
export function encodeFrame(message: unknown, maxBytes = MAX_FRAME_BYTES): Buffer {
  const data = Buffer.from(encodeJson(message), 'utf8');
  if (data.length > maxBytes) {
    throw new FrameError(
      `a message of ${data.length} bytes exceeds the frame limit of ${maxBytes}`,
    );
  }
  const prefix = Buffer.allocUnsafe(PREFIX_BYTES);
  prefix.writeUInt32BE(data.length, 0);
  return Buffer.concat([prefix, data]);
}

/** Reads frames out of a byte stream, chunk by chunk. */
export class FrameReader {
  readonly #maxBytes: number;
  #chunks: Buffer[] = [];
  #buffered = 0;

  constructor(maxBytes = MAX_FRAME_BYTES) {
    this.#maxBytes = maxBytes;
  }

  /** Adds a chunk; returns the messages it completed. Throws `FrameError` on a corrupt frame. */
  push(chunk: Buffer): JsonValue[] {
    this.#chunks.push(chunk);
    this.#buffered += chunk.length;
    const messages: JsonValue[] = [];
    for (;;) {
      if (this.#buffered < PREFIX_BYTES) return messages;
      const size = this.#peekSize();
      if (size > this.#maxBytes) {
        throw new FrameError(`a frame of ${size} bytes exceeds the limit of ${this.#maxBytes}`);
      }
      if (this.#buffered < PREFIX_BYTES + size) return messages;
      const frame = this.#take(PREFIX_BYTES + size).subarray(PREFIX_BYTES);
      messages.push(this.#decode(frame));
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

  #decode(frame: Buffer): JsonValue {
    try {
      return decodeJson(frame.toString('utf8'));
    } catch (err) {
      throw new FrameError(`a frame is not JSON: ${(err as Error).message}`);
    }
  }
}
