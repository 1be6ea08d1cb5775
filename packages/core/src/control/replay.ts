/**
 * What the plane remembers so a controller's retry gets the answer it missed: the replies of the
 * open checkpoint's completed operations (replayed for the same arguments, a conflict for others)
 * and the ids of recently resumed checkpoints (a delayed call of one is fenced).
 */
import { CheckpointConflictError } from '../errors.js';
import { captureKey, type EpisodeId } from '../identity.js';

/** Directory and scope (as capture keys) of a call, compared on replay. */
export interface CallArgs {
  readonly dir: string;
  readonly scope: ReadonlySet<string> | null;
}

/** Prepare has no directory or scope: a repeated prepare of the same checkpoint always matches. */
export const PREPARE_ARGS: CallArgs = { dir: '', scope: null };

export function callArgs(checkpointDir: string, scope: readonly EpisodeId[] | null): CallArgs {
  return { dir: checkpointDir, scope: scope === null ? null : new Set(scope.map(captureKey)) };
}

/** Same directory and the same scope in any order (a set: no sort of thousands of keys). */
export function sameArgs(a: CallArgs, b: CallArgs): boolean {
  if (a.dir !== b.dir) return false;
  if (a.scope === null || b.scope === null) return a.scope === b.scope;
  if (a.scope.size !== b.scope.size) return false;
  for (const key of a.scope) if (!b.scope.has(key)) return false;
  return true;
}

interface Recorded<T> {
  readonly checkpointId: string;
  /** The arguments it ran with, compared on replay. */
  readonly args: CallArgs;
  readonly reply: T;
}

/** The completed operations of the open checkpoint, one reply per operation (`M`: operation → reply). */
export class RecordedReplies<M extends Record<string, object>> {
  readonly #recorded = new Map<keyof M, Recorded<M[keyof M]>>();

  record<K extends keyof M & string>(
    op: K,
    checkpointId: string,
    args: CallArgs,
    reply: M[K],
  ): void {
    this.#recorded.set(op, { checkpointId, args, reply });
  }

  /** The reply `op` gave for the same arguments; another directory or scope conflicts. */
  replay<K extends keyof M & string>(
    op: K,
    checkpointId: string,
    args: CallArgs,
  ): M[K] | undefined {
    const recorded = this.#recorded.get(op);
    if (recorded === undefined || recorded.checkpointId !== checkpointId) return undefined;
    if (!sameArgs(recorded.args, args)) {
      throw new CheckpointConflictError(
        `checkpoint ${checkpointId} already completed ${op} with another directory or scope`,
      );
    }
    return recorded.reply as M[K];
  }

  /** The checkpoint ended: nothing of it is replayed any more. */
  clear(): void {
    this.#recorded.clear();
  }
}

/** The insertion-ordered memory of resumed checkpoint ids; the oldest is evicted when full. */
export class RecentIds {
  readonly #ids = new Set<string>();
  constructor(private readonly capacity: number) {}

  add(id: string): void {
    if (this.#ids.has(id)) return;
    this.#ids.add(id);
    if (this.#ids.size > this.capacity) this.#ids.delete(this.#ids.values().next().value as string);
  }

  has(id: string): boolean {
    return this.#ids.has(id);
  }
}
