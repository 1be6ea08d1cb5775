/**
 * Loading a stack file, and writing the resolved copy `up` starts every process from: the same
 * file with a fixed port for every server that had port 0 (other servers reach it by name, so its
 * port must be known before anything starts), and the original file's path under
 * `x-ckpt-gym-source`, so relative paths in it keep resolving against the original directory.
 */
import { readFileSync } from 'node:fs';
import { join, resolve } from 'node:path';

import { ConfigError } from '@ckpt-gym/core/protocol';
import { type Env, parseStackFile, type StackSettings } from '@ckpt-gym/core/server';
import { parseDocument } from 'yaml';

import { KIND_SCHEMAS } from './serve.js';

/** The key (ignored by core, like every `x-` key) that names the file a resolved copy came from. */
export const SOURCE_KEY = 'x-ckpt-gym-source';

function readStackText(path: string): string {
  try {
    return readFileSync(path, 'utf8');
  } catch (err) {
    throw new ConfigError(`${path}: cannot read the stack file: ${(err as Error).message}`, {
      cause: err,
    });
  }
}

/** The source a resolved copy names, or undefined for an ordinary stack file. */
export function sourceOf(text: string): string | undefined {
  const doc = parseDocument(text);
  const source: unknown = doc.errors.length === 0 ? doc.get(SOURCE_KEY) : undefined;
  return typeof source === 'string' && source !== '' ? source : undefined;
}

/**
 * Like core's `loadStackFile`, but a resolved copy resolves relative paths like its source; every
 * server's keys are checked against its kind's schema.
 */
export function loadStack(path: string, env: Env = process.env): StackSettings {
  const text = readStackText(path);
  const source = sourceOf(text);
  const settings = parseStackFile(text, { env, source: source ?? path, kinds: KIND_SCHEMAS });
  // Messages name the file actually read.
  return source === undefined ? settings : { ...settings, source: path };
}

/** Where a launch keeps the token-capture ledgers of a stack that does not name a directory. */
export const RUN_CAPTURE_DIR = 'capture';

/**
 * The resolved copy's text: `ports` replace the servers' ports; the source is recorded. A stack
 * that does not name its token-capture directory keeps its ledgers in the run directory
 * (`<runDir>/capture`), so two launches never share one; a named directory is kept.
 */
export function resolvedStackText(
  sourcePath: string,
  ports: ReadonlyMap<string, number>,
  runDir: string,
): string {
  const text = readStackText(sourcePath);
  const doc = parseDocument(text);
  for (const [name, port] of ports) doc.setIn(['servers', name, 'port'], port);
  if (!doc.hasIn(['token_capture', 'dir'])) {
    doc.setIn(['token_capture', 'dir'], join(resolve(runDir), RUN_CAPTURE_DIR));
  }
  doc.set(SOURCE_KEY, sourceOf(text) ?? resolve(sourcePath));
  return doc.toString();
}
