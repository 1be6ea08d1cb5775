/**
 * Child processes cannot use jest's transform: `transpileCore` compiles every module of core's
 * `src/` with swc into a temporary ESM directory, so a child runs the sources under test and not
 * a `dist/` that may be stale.
 */
import { mkdir, mkdtemp, readdir, rm, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';

const srcDir = join(import.meta.dirname, '..', '..', 'src');

/** Transpiles core's sources; resolves with the directory, whose `index.js` is the package entry. */
export async function transpileCore(): Promise<string> {
  const { transformFile } = (await import('@swc/core')) as typeof import('@swc/core');
  // Under core's own node_modules, so the sources' packages resolve as from src/ (ajv 8 is core's
  // own; the repository's node_modules holds another ajv).
  const cache = join(srcDir, '..', 'node_modules', '.cache');
  await mkdir(cache, { recursive: true });
  const out = await mkdtemp(join(cache, 'ckpt-gym-core-child-'));
  await writeFile(join(out, 'package.json'), '{"type": "module"}');
  const files = (await readdir(srcDir, { recursive: true })).filter((f) => f.endsWith('.ts'));
  for (const file of files) {
    const { code } = await transformFile(join(srcDir, file), {
      jsc: { parser: { syntax: 'typescript' }, target: 'es2022' },
      module: { type: 'es6' },
    });
    const target = join(out, file.replace(/\.ts$/, '.js'));
    await mkdir(dirname(target), { recursive: true });
    await writeFile(target, code);
  }
  return out;
}

/** Removes what `transpileCore` wrote. */
export async function removeTranspiled(dir: string): Promise<void> {
  await rm(dir, { recursive: true, force: true });
}
