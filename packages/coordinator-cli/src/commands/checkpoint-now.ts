/**
 * `checkpoint-now`: ask a running collection for a checkpoint. It signals the pid the collector
 * wrote to its directory, so the signal reaches the collector itself whether it was started with
 * node, npx or npm (a wrapper would open node's inspector on SIGUSR1, or die of SIGTERM), then
 * waits for LATEST to name a new checkpoint.
 */
import { resolve } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';

import { CollectionDir, PID_FILE, processAlive } from '../collection/files.js';
import { CliFailure, type CommandContext, describe } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import type { CommandResult } from '../output.js';

const POLL_MS = 100;

export async function checkpointNowCommand(ctx: CommandContext): Promise<CommandResult> {
  const root = resolve(ctx.io.cwd, ctx.invocation.checkpointDir ?? '');
  const dir = new CollectionDir(root);
  const pid = dir.readPid();
  if (pid === undefined || !processAlive(pid)) {
    throw new CliFailure(
      `no collection is running in ${root}: ${pid === undefined ? `no ${PID_FILE}` : `pid ${pid} is gone`}`,
    );
  }
  const before = dir.latest()?.manifest.checkpoint_id;
  const stop = ctx.invocation.stop;
  try {
    process.kill(pid, stop ? 'SIGTERM' : 'SIGUSR1');
  } catch (err) {
    throw new CliFailure(`cannot signal the collector (pid ${pid}): ${describe(err)}`);
  }
  const end = ctx.deadlineTs();
  while (ctx.nowSeconds() < end) {
    const latest = dir.latest()?.manifest.checkpoint_id;
    if (latest !== undefined && latest !== before) {
      return {
        exitCode: ExitCode.OK,
        data: { pid, checkpoint_id: latest, checkpoint_dir: resolve(root, latest), stop },
        text: `checkpoint ${latest} published in ${resolve(root, latest)}${stop ? '; the collection stops (exit 75)' : ''}`,
      };
    }
    if (!processAlive(pid)) break;
    await sleep(POLL_MS);
  }
  throw new CliFailure(
    processAlive(pid)
      ? `the collector (pid ${pid}) published no checkpoint within ${ctx.invocation.deadlineSeconds} s; its output says why`
      : `the collector (pid ${pid}) exited without publishing a checkpoint; its output says why`,
    {},
    ExitCode.FAILURE,
    { pid },
  );
}
