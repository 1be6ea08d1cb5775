/**
 * Which entries of a collection's checkpoint directory go once a checkpoint is published: every
 * published checkpoint but the newest `keep` (the latest and the one before it), checkpoint
 * directories a failed commit or publish left without a manifest (nothing restores them), and
 * dot files (the temporaries of an atomic write a crash left behind). Pure.
 */
export const KEEP_CHECKPOINTS = 2;
/** Every checkpoint directory the collection writes is `<prefix><time>`. */
export const CHECKPOINT_PREFIX = 'ckpt-';

export interface CheckpointDirEntry {
  readonly name: string;
  readonly isDirectory: boolean;
  /** The `created_at` of its collection.json, for a published checkpoint. */
  readonly createdAt?: number;
}

export function entriesToRemove(
  entries: readonly CheckpointDirEntry[],
  keep: number = KEEP_CHECKPOINTS,
): string[] {
  const published = entries
    .filter((e) => e.isDirectory && e.createdAt !== undefined)
    .sort((a, b) => a.createdAt! - b.createdAt!);
  const old = published.slice(0, Math.max(0, published.length - keep)).map((e) => e.name);
  const partial = entries
    .filter(
      (e) => e.isDirectory && e.createdAt === undefined && e.name.startsWith(CHECKPOINT_PREFIX),
    )
    .map((e) => e.name);
  const temporary = entries
    .filter((e) => !e.isDirectory && e.name.startsWith('.'))
    .map((e) => e.name);
  return [...old, ...partial, ...temporary];
}
