/**
 * What the collection e2e tests share: one collection (`ckpt-gym run`) in a deployment's run
 * directory, its task file, output rows, sidecar and checkpoint directory.
 */
import { existsSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';

import { CollectionDir, failuresPathFor, MANIFEST_FILE } from '@ckpt-gym/coordinator-cli';

import type { Deployment } from './support/deployment.js';
import { weatherEpisode } from './support/stacks.js';

export interface OutputRow {
  run_id: string;
  rollout_id: string;
  attempt: number;
  result: { reward?: number } | null;
  failure: unknown;
  capture_failures?: string[];
}

export function readRows<T = OutputRow>(path: string): T[] {
  if (!existsSync(path)) return [];
  return readFileSync(path, 'utf8')
    .split('\n')
    .filter(Boolean)
    .map((line) => JSON.parse(line) as T);
}

/** A rollout id without its run's prefix: the task's key. */
export const taskKey = (rolloutId: string) => rolloutId.slice(rolloutId.indexOf('.') + 1);

/** Our weather task lines, one per key (each its `rollout_id`). */
export function weatherTasks(keys: readonly string[]): string {
  const lines = keys.map((key) => {
    const { task } = weatherEpisode(key) as { task: Record<string, unknown> };
    return JSON.stringify({ rollout_id: key, ...task });
  });
  return `${lines.join('\n')}\n`;
}

export class Collection {
  readonly input: string;
  readonly output: string;
  readonly checkpointDir: string;

  constructor(
    readonly dep: Deployment,
    name = 'col',
    inputText?: string,
  ) {
    this.input = join(dep.runDir, `${name}.tasks.jsonl`);
    this.output = join(dep.runDir, `${name}.results.jsonl`);
    this.checkpointDir = join(dep.runDir, `${name}.checkpoints`);
    if (inputText !== undefined) writeFileSync(this.input, inputText);
  }

  args(extra: readonly string[] = [], concurrency = 8): string[] {
    return [
      'run',
      '--input',
      this.input,
      '--output',
      this.output,
      '--checkpoint-dir',
      this.checkpointDir,
      '--concurrency',
      String(concurrency),
      ...extra,
    ];
  }

  rows<T = OutputRow>(): T[] {
    return readRows<T>(this.output);
  }

  failures<T = Record<string, unknown>>(): T[] {
    return readRows<T>(failuresPathFor(this.output));
  }

  dir(): CollectionDir {
    return new CollectionDir(this.checkpointDir);
  }

  /** The checkpoint directories that hold a collection.json. */
  published(): string[] {
    if (!existsSync(this.checkpointDir)) return [];
    return readdirSync(this.checkpointDir)
      .filter((name) => existsSync(join(this.checkpointDir, name, MANIFEST_FILE)))
      .sort();
  }
}
