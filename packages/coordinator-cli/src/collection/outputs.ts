/**
 * The collection's output files: `--output`, and for NeMo Gym rows the `<stem>_failures.jsonl`
 * sidecar the failed episodes go to. Each outcome is appended once, in completion order.
 */
import { existsSync, readFileSync } from 'node:fs';
import { appendFile } from 'node:fs/promises';
import { join } from 'node:path';

import { captureKey, type EpisodeId } from '@ckpt-gym/core/protocol';
import { type TokenCaptureSettings } from '@ckpt-gym/core/server';
import { LEDGER_SUFFIX } from '@ckpt-gym/policy-model-server';

import type { InputFormat } from '../collect.js';
import { failuresPathFor, type JsonRow } from './nemo.js';
import { captureFailuresIn, outcomesIn } from './rows.js';

const readIfThere = (path: string) => (existsSync(path) ? readFileSync(path, 'utf8') : '');

export class Outputs {
  /** Where failed NeMo Gym rows go; our rows keep their failure inline. */
  readonly failuresPath: string | undefined;
  #writes: Promise<void> = Promise.resolve();

  constructor(
    readonly path: string,
    format: InputFormat,
  ) {
    this.failuresPath = format === 'nemo' ? failuresPathFor(path) : undefined;
  }

  /** The rollouts with an outcome already, and the runs the rows belong to. */
  read(): { finished: Set<string>; runs: Set<string> } {
    const paths = [this.path, ...(this.failuresPath === undefined ? [] : [this.failuresPath])];
    return outcomesIn(paths.map(readIfThere));
  }

  /** Appends `row` to the output (or, `failed`, to the sidecar when there is one). */
  write(row: JsonRow, failed: boolean): Promise<void> {
    const path = failed && this.failuresPath !== undefined ? this.failuresPath : this.path;
    this.#writes = this.#writes.then(() => appendFile(path, `${JSON.stringify(row)}\n`));
    return this.#writes;
  }

  flushed(): Promise<void> {
    return this.#writes;
  }
}

/** The failed lineage rows of `episode`'s attempt in the capture ledger (none with capture off). */
export function captureFailures(capture: TokenCaptureSettings, episode: EpisodeId): string[] {
  if (!capture.enabled) return [];
  return captureFailuresIn(
    readIfThere(join(capture.dir, `${captureKey(episode)}${LEDGER_SUFFIX}`)),
  );
}
