/**
 * The stack tests spawn `dist/main.js serve …`, which runs the built packages: build each one
 * whose dist is missing or older than its sources, in dependency order.
 */
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, readdirSync, readFileSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

export const REPO = fileURLToPath(new URL('../../../../', import.meta.url));

export const BUILD_ORDER = [
  'core',
  'fake-inference',
  'resources-server',
  'policy-model-server',
  'agent-server',
  'environment-server',
  'coordinator-cli',
];

function newestSource(dir: string): number {
  let newest = 0;
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    const path = join(dir, entry.name);
    newest = Math.max(newest, entry.isDirectory() ? newestSource(path) : statSync(path).mtimeMs);
  }
  return newest;
}

/** A file the package's build writes: its first entry point (core has only subpath entries). */
function builtEntry(pkg: string): string {
  const dir = join(REPO, 'packages', pkg);
  const manifest = JSON.parse(readFileSync(join(dir, 'package.json'), 'utf8')) as {
    exports: Record<string, { import: string }>;
  };
  const [first] = Object.values(manifest.exports);
  return join(dir, first!.import);
}

function stale(pkg: string): boolean {
  const built = builtEntry(pkg);
  return (
    !existsSync(built) || statSync(built).mtimeMs < newestSource(join(REPO, 'packages', pkg, 'src'))
  );
}

/** Jest runs suites in parallel workers: one builds while the others wait. */
const LOCK = join(tmpdir(), 'ckpt-gym-build.lock');
const STALE_LOCK_MS = 5 * 60_000;

function withLock(work: () => void): void {
  for (;;) {
    try {
      mkdirSync(LOCK);
      break;
    } catch {
      const since = statSync(LOCK, { throwIfNoEntry: false })?.mtimeMs ?? Date.now();
      if (Date.now() - since > STALE_LOCK_MS) {
        rmSync(LOCK, { recursive: true, force: true });
      }
      Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 200);
    }
  }
  try {
    work();
  } finally {
    rmSync(LOCK, { recursive: true, force: true });
  }
}

export function ensureBuilt(): void {
  withLock(build);
}

function build(): void {
  const tsc = join(REPO, 'node_modules/typescript/bin/tsc');
  let rebuilt = false;
  for (const pkg of BUILD_ORDER) {
    // A rebuilt dependency changes the .d.ts its dependents compile against.
    if (!rebuilt && !stale(pkg)) continue;
    rebuilt = true;
    const result = spawnSync(
      process.execPath,
      [tsc, '-p', join(REPO, 'packages', pkg, 'tsconfig.build.json')],
      { encoding: 'utf8' },
    );
    if (result.status !== 0) {
      throw new Error(`building ${pkg} failed:\n${result.stdout}${result.stderr}`);
    }
  }
}
