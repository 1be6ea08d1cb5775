/**
 * A collection's checkpoints (#3893): SIGUSR1 and the `--checkpoint-every` timer take one and the
 * collection goes on; SIGTERM takes one and stops it. One at a time, new sends paused meanwhile.
 * Each runs `checkpoint` (its commit scope: the episodes in flight on the environment servers),
 * then publishes `collection.json` and `LATEST` and drops what retention drops.
 */
import { join } from 'node:path';

import { inSpan } from '@ckpt-gym/core/client';
import { ATTR_CHECKPOINT_ID } from '@ckpt-gym/core/server';

import type { Collector } from '../collect.js';
import type { CollectionDir } from '../collection/files.js';
import { collectionManifest, type LogHead } from '../collection/resume.js';
import { type CommandContext, describe, generatedId } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import { readControllerRecord } from '../publication.js';
import { CHECKPOINT_SPAN } from '../tracing.js';
import { checkpointCommand } from './checkpoint.js';
import { subContext } from './common.js';

export class CollectionCheckpoints {
  readonly published: string[] = [];
  /** Set once SIGTERM asked to stop: the checkpoint it took, or null when that one failed. */
  stoppedAt: string | null | undefined;
  #chain: Promise<void> = Promise.resolve();

  constructor(
    private readonly ctx: CommandContext,
    private readonly dir: CollectionDir,
    private readonly head: LogHead,
    private readonly collector: Collector,
  ) {}

  /** Queues a checkpoint; after a stop, nothing more is taken. */
  take(stop: boolean): void {
    this.#chain = this.#chain.then(() => this.#take(stop));
  }

  settled(): Promise<void> {
    return this.#chain;
  }

  /** Installs SIGUSR1, SIGTERM and the timer; returns what removes them. */
  install(everySeconds: number | undefined): () => void {
    const onUsr1 = () => this.take(false);
    const onTerm = () => this.take(true);
    process.on('SIGUSR1', onUsr1);
    process.on('SIGTERM', onTerm);
    const timer =
      everySeconds === undefined
        ? undefined
        : setInterval(() => {
            if (this.collector.inFlight.size > 0) this.take(false);
          }, everySeconds * 1000);
    return () => {
      process.off('SIGUSR1', onUsr1);
      process.off('SIGTERM', onTerm);
      clearInterval(timer);
    };
  }

  async #take(stop: boolean): Promise<void> {
    if (this.stoppedAt !== undefined) return;
    const id = generatedId('ckpt');
    // Each checkpoint its own trace, whatever context the signal or timer fired in.
    const options = { root: true, attributes: { [ATTR_CHECKPOINT_ID]: id } };
    await inSpan(CHECKPOINT_SPAN, options, () => this.#checkpoint(id, stop));
  }

  async #checkpoint(id: string, stop: boolean): Promise<void> {
    this.collector.pause();
    const target = join(this.dir.root, id);
    const argv = ['checkpoint', '--id', id, '--dir', target, ...(stop ? ['--stop'] : [])];
    const sub = subContext(this.ctx, argv);
    let published = false;
    try {
      const result = await checkpointCommand(sub);
      this.ctx.progress(result.text);
      if (result.exitCode === ExitCode.OK) {
        const record = await readControllerRecord(target, this.ctx.stack.checkpoint?.signingKey);
        if (record === undefined) throw new Error(`${target} has no controller record`);
        await this.dir.publish(collectionManifest(this.head, record, this.ctx.nowSeconds()));
        this.published.push(id);
        published = true;
        this.ctx.progress(
          `checkpoint ${id} published (LATEST): ${record.episode_ids.length} row(s) in flight ` +
            `continue, ${record.restarts.length} restart`,
        );
      }
    } catch (err) {
      this.ctx.progress(`checkpoint ${id} failed: ${describe(err)}; the previous one stays LATEST`);
    } finally {
      sub.close();
      if (stop) {
        this.stoppedAt = published ? id : null;
        this.collector.abort();
      } else {
        this.collector.unpause();
      }
    }
  }
}
