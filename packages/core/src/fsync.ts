/**
 * Directory fsyncs. A file's data is durable after fsyncing the file, but its name is durable only
 * once the directory holding the name is fsynced too; a freshly created directory needs its
 * parent fsynced for the same reason.
 */
import { open } from 'node:fs/promises';
import { dirname, resolve } from 'node:path';

/** fsyncs one directory (its entries: created, renamed and linked names). */
export async function fsyncDirectory(dir: string): Promise<void> {
  const handle = await open(dir, 'r');
  try {
    await handle.sync();
  } finally {
    await handle.close();
  }
}

/**
 * The parents of `dir` up to and including `top`, nearest first: the directories whose entries
 * hold `dir` and its ancestors below `top`. Empty when `dir` is `top` or not inside it.
 */
export function parentsUpTo(dir: string, top: string): string[] {
  const root = resolve(top);
  const parents: string[] = [];
  let current = resolve(dir);
  while (current !== root) {
    const parent = dirname(current);
    if (parent === current) return []; // reached `/` without meeting `top`
    parents.push(parent);
    current = parent;
  }
  return parents;
}
