/** runCli in-process with captured output. */
import { existsSync, rmSync } from 'node:fs';
import { join } from 'node:path';

import { attachStack, RUN_FILE, runCli } from '../../src/index.js';

export interface CliRun {
  code: number;
  stdout: string;
  stderr: string;
  /** stdout parsed, for `--json` runs. */
  json(): Record<string, unknown>;
}

export async function cli(argv: string[], cwd: string): Promise<CliRun> {
  let stdout = '';
  let stderr = '';
  const code = await runCli(argv, {
    stdout: { write: (chunk: string) => (stdout += chunk) },
    stderr: { write: (chunk: string) => (stderr += chunk) },
    env: process.env,
    cwd,
  });
  return { code, stdout, stderr, json: () => JSON.parse(stdout) as Record<string, unknown> };
}

export function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/** After a test: SIGKILLs what the stack of `<dir>/run` left running, then removes `dir`. */
export async function removeTestDir(dir: string): Promise<void> {
  if (existsSync(join(dir, 'run', RUN_FILE)))
    await attachStack(join(dir, 'run')).crash({ all: true });
  rmSync(dir, { recursive: true, force: true });
}
