/**
 * Request and reply messages in both directions over one Unix-socket connection (one per worker).
 * A request's send and its reply share one timeout; a timeout or a lost connection is a typed,
 * retryable `checkpoint_coordinator_unavailable`. A handler's typed error is the caller's typed
 * error; an untyped throw is `checkpoint_error`; a reply that cannot be framed is answered with a
 * typed `invalid_checkpoint_state` error instead, so the caller never waits to its deadline. A
 * handler may answer `WithBytes`: the caller's reply is then a `WithBytes` too; a request sent as
 * `WithBytes` (the coordinator's install) reaches its handler with the bytes beside its body.
 */
import type { Socket } from 'node:net';

import {
  CheckpointError,
  CheckpointStateError,
  CkptGymError,
  CoordinatorUnavailableError,
  isErrorCode,
} from '../errors.js';
import type { JsonValue } from '../json.js';
import type { Logger } from '../logging.js';
import { encodeFrame, FrameReader, framePieces, WithBytes } from './frames.js';
import type {
  ChannelError,
  ChannelHandler,
  ChannelReply,
  ChannelRequest,
  ImmediateHandler,
} from './types.js';
import { MESSAGE_TIMEOUT_MS } from './types.js';

export interface ChannelOptions {
  readonly handler: ChannelHandler;
  readonly immediate?: ImmediateHandler;
  readonly logger?: Logger;
  /** Names the other end in errors ("the coordinator", "model worker 2"). */
  readonly peer?: string;
  /** Frame limit (default MAX_FRAME_BYTES); smaller only in tests. */
  readonly maxFrameBytes?: number;
}

interface Pending {
  readonly kind: string;
  resolve(body: JsonValue | WithBytes): void;
  reject(err: Error): void;
}

/** The typed error a reply carries, as the error it was raised as on the other side. */
export function errorOfReply(error: ChannelError): CkptGymError {
  return isErrorCode(error.code)
    ? new CkptGymError(error.code, error.detail)
    : new CheckpointError(`${error.code}: ${error.detail}`);
}

/** What a handler's throw is answered with: its typed error, or `checkpoint_error`. */
export function replyError(err: unknown): ChannelError {
  const typed = err instanceof CkptGymError ? err : new CheckpointError(describeThrow(err));
  return { status: typed.status, code: typed.code, detail: typed.detail };
}

function describeThrow(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}

function isReply(message: JsonValue): message is ChannelReply & JsonValue {
  return typeof message === 'object' && message !== null && 'reply_to' in message;
}

export class Channel {
  readonly #socket: Socket;
  readonly #options: ChannelOptions;
  readonly #reader: FrameReader;
  readonly #pending = new Map<number, Pending>();
  readonly #closeListeners = new Set<() => void>();
  #nextId = 0;
  #closed = false;

  constructor(socket: Socket, options: ChannelOptions) {
    this.#socket = socket;
    this.#options = options;
    this.#reader = new FrameReader(options.maxFrameBytes);
    socket.on('data', (chunk: Buffer) => this.#receive(chunk));
    socket.on('error', () => socket.destroy());
    socket.on('close', () => this.#onClose());
  }

  get closed(): boolean {
    return this.#closed;
  }

  /** Calls `listener` once the connection closed (at once if it has). */
  onClose(listener: () => void): void {
    if (this.#closed) listener();
    else this.#closeListeners.add(listener);
  }

  /**
   * Sends a request (`WithBytes`: its bytes travel unencoded beside the body) and waits for its
   * reply, both within `timeoutMs`: its body, or `WithBytes` when the handler answered with bytes.
   * Rejects with the reply's typed error, or `CoordinatorUnavailableError` on a timeout or a lost
   * connection.
   */
  call(
    kind: string,
    body: unknown,
    timeoutMs = MESSAGE_TIMEOUT_MS,
  ): Promise<JsonValue | WithBytes> {
    if (this.#closed) return Promise.reject(this.#unavailable(kind, 'the connection is closed'));
    this.#nextId += 1;
    const id = this.#nextId;
    return new Promise<JsonValue | WithBytes>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.#pending.delete(id);
        reject(this.#unavailable(kind, `no reply within ${timeoutMs} ms`));
      }, timeoutMs);
      const settle =
        <T>(fn: (value: T) => void) =>
        (value: T): void => {
          clearTimeout(timer);
          this.#pending.delete(id);
          fn(value);
        };
      this.#pending.set(id, { kind, resolve: settle(resolve), reject: settle(reject) });
      let pieces: Uint8Array[];
      try {
        pieces =
          body instanceof WithBytes
            ? framePieces({ id, kind, body: body.body }, this.#options.maxFrameBytes, body.bytes)
            : [encodeFrame({ id, kind, body }, this.#options.maxFrameBytes)];
      } catch (err) {
        settle(reject)(
          new CheckpointStateError(`message ${kind} cannot be framed: ${describeThrow(err)}`),
        );
        return;
      }
      this.#write(pieces);
    });
  }

  /** Ends the connection (a clean close: the other end sees it close). */
  close(): void {
    this.#socket.end();
  }

  /** Drops the connection at once. */
  destroy(): void {
    this.#socket.destroy();
  }

  #unavailable(kind: string, why: string): CoordinatorUnavailableError {
    const peer = this.#options.peer ?? 'the other process';
    return new CoordinatorUnavailableError(`checkpoint message ${kind} to ${peer} failed: ${why}`);
  }

  #receive(chunk: Buffer): void {
    let messages: (JsonValue | WithBytes)[];
    try {
      messages = this.#reader.push(chunk);
    } catch (err) {
      this.#options.logger?.error('checkpoint channel frame rejected; closing the connection', {
        error: describeThrow(err),
      });
      this.#socket.destroy();
      return;
    }
    for (const message of messages) {
      const body = message instanceof WithBytes ? message.body : message;
      const bytes = message instanceof WithBytes ? message.bytes : undefined;
      if (isReply(body)) this.#settle(body, bytes);
      else this.#serve(body as unknown as ChannelRequest, bytes);
    }
  }

  #settle(reply: ChannelReply, bytes?: Uint8Array): void {
    const pending = this.#pending.get(reply.reply_to);
    if (!pending) return;
    if (!reply.ok) pending.reject(errorOfReply(reply.error));
    else if (bytes === undefined) pending.resolve(reply.body as JsonValue);
    else pending.resolve(new WithBytes(reply.body as JsonValue, bytes));
  }

  #serve(request: ChannelRequest, bytes: Uint8Array | undefined): void {
    const { immediate, handler } = this.#options;
    if (immediate) {
      let body: unknown;
      try {
        body = immediate(request.kind, request.body);
      } catch (err) {
        this.#reply(request, { reply_to: request.id, ok: false, error: replyError(err) });
        return;
      }
      if (body !== undefined) {
        this.#reply(request, { reply_to: request.id, ok: true, body });
        return;
      }
    }
    handler(request.kind, request.body, bytes).then(
      (body) => this.#reply(request, { reply_to: request.id, ok: true, body }),
      (err: unknown) => {
        if (!(err instanceof CkptGymError)) {
          this.#options.logger?.error('checkpoint message failed', {
            kind: request.kind,
            error: describeThrow(err),
          });
        }
        this.#reply(request, { reply_to: request.id, ok: false, error: replyError(err) });
      },
    );
  }

  /** Writes the reply, or a typed error when it cannot be framed. Each frame is written whole. */
  #reply(request: ChannelRequest, reply: ChannelReply): void {
    if (this.#closed) return;
    let pieces: Uint8Array[];
    try {
      const answer = reply.ok ? reply.body : undefined;
      pieces =
        answer instanceof WithBytes
          ? framePieces({ ...reply, body: answer.body }, this.#options.maxFrameBytes, answer.bytes)
          : [encodeFrame(reply, this.#options.maxFrameBytes)];
    } catch (err) {
      this.#options.logger?.error('checkpoint reply cannot be framed', {
        kind: request.kind,
        error: describeThrow(err),
      });
      const error = replyError(
        new CheckpointStateError(
          `the reply to ${request.kind} cannot be framed: ${describeThrow(err)}`,
        ),
      );
      pieces = [encodeFrame({ reply_to: request.id, ok: false, error } satisfies ChannelReply)];
    }
    this.#write(pieces);
  }

  /** One gathered write (writev): a frame's pieces go out together, none copied into one buffer. */
  #write(pieces: readonly Uint8Array[]): void {
    this.#socket.cork();
    for (const piece of pieces) this.#socket.write(piece);
    this.#socket.uncork();
  }

  #onClose(): void {
    if (this.#closed) return;
    this.#closed = true;
    for (const [, pending] of this.#pending) {
      pending.reject(this.#unavailable(pending.kind, 'the connection closed'));
    }
    this.#pending.clear();
    for (const listener of this.#closeListeners) listener();
    this.#closeListeners.clear();
  }
}
