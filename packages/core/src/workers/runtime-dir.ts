/**
 * One runtime directory per server process, for its coordinator socket: a short path under /tmp
 * (`/tmp/cg-<pid>-<random>/`), because AF_UNIX socket paths are limited to about 100 bytes and
 * `os.tmpdir()` can be long. It is removed at exit (a normal exit, SIGTERM, SIGINT); one left by
 * a process that died without cleaning up (its pid is dead) is removed when the next one starts.
 */
import { randomBytes } from 'node:crypto';
import { mkdirSync, readdirSync, rmSync } from 'node:fs';
import { join } from 'node:path';

export const RUNTIME_ROOT = '/tmp';
const PREFIX = 'cg-';
const NAME = /^cg-(\d+)-[0-9a-f]+$/;

/** True when a process with `pid` exists (EPERM: it exists, owned by another user). */
export function pidAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/** Removes the runtime directories under `root` whose process is dead; returns their paths. */
export function cleanStaleRuntimeDirs(
  root = RUNTIME_ROOT,
  alive: (pid: number) => boolean = pidAlive,
): string[] {
  const removed: string[] = [];
  let names: string[];
  try {
    names = readdirSync(root);
  } catch {
    return removed;
  }
  for (const name of names) {
    const match = NAME.exec(name);
    if (!match || alive(Number(match[1]))) continue;
    const path = join(root, name);
    try {
      rmSync(path, { recursive: true, force: true });
      removed.push(path);
    } catch {
      // Another user's directory, or removed meanwhile: not ours to clean.
    }
  }
  return removed;
}

export interface RuntimeDir {
  readonly path: string;
  /** Removes the directory now (idempotent); also runs at exit. */
  remove(): void;
}

/**
 * Creates this process's runtime directory (mode 0700) after cleaning stale ones, and removes it
 * at exit. A SIGTERM or SIGINT with no other listener exits 0 after removing it; with listeners
 * (a server process stopping itself) they own the exit, and the exit hook removes it.
 */
export function createRuntimeDir(root = RUNTIME_ROOT): RuntimeDir {
  cleanStaleRuntimeDirs(root);
  const path = join(root, `${PREFIX}${process.pid}-${randomBytes(4).toString('hex')}`);
  mkdirSync(path, { mode: 0o700 });
  let removed = false;
  const remove = (): void => {
    if (removed) return;
    removed = true;
    process.off('exit', remove);
    process.off('SIGTERM', onSignal);
    process.off('SIGINT', onSignal);
    rmSync(path, { recursive: true, force: true });
  };
  const onSignal = (signal: NodeJS.Signals): void => {
    // Alone, this listener replaced the default action (exit), so it exits itself.
    if (process.listenerCount(signal) > 1) return;
    remove();
    process.exit(0);
  };
  process.on('exit', remove);
  process.on('SIGTERM', onSignal);
  process.on('SIGINT', onSignal);
  return { path, remove };
}
