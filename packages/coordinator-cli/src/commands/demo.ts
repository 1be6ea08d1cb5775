/** `demo`: the crash-and-restore demo on the embedded stack (see ../demo.ts). */
import { mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';

import type { CommandContext } from '../context.js';
import { type DemoReport, runDemo } from '../demo.js';
import { ExitCode } from '../exit-codes.js';
import { type CommandResult, table } from '../output.js';

export function demoTable(report: DemoReport): string {
  const rewards = Object.entries(report.rewards)
    .map(([reward, count]) => `${count} × ${reward}`)
    .join(', ');
  return table(
    ['', ''],
    [
      [
        'rollouts',
        `${report.rollouts} (${Object.entries(report.tasksets)
          .map(([set, count]) => `${count} ${set}`)
          .join(', ')})`,
      ],
      ['finished before the checkpoint', String(report.finished_before_checkpoint)],
      ['continued after the crash', String(report.continued)],
      ['tools', report.tools],
      ['restarted after the crash', String(report.restarted)],
      [
        'model calls made / minimum',
        `${report.model_calls} / ${report.minimum_model_calls} (${report.delivered_model_calls} delivered; the others were held when the gym was killed)`,
      ],
      ['delivered model calls repeated', String(report.repeated_model_calls)],
      ['rollouts not finished exactly once', String(report.not_exactly_once.length)],
      ['rewards', rewards === '' ? '-' : rewards],
      ['time', `${report.seconds.total ?? 0} s`],
    ],
  )
    .split('\n')
    .slice(1)
    .join('\n');
}

export async function demoCommand(ctx: CommandContext): Promise<CommandResult> {
  const given = ctx.invocation.runDir;
  const workDir = given
    ? resolve(ctx.io.cwd, given)
    : mkdtempSync(join(tmpdir(), 'ckpt-gym-demo-'));
  mkdirSync(workDir, { recursive: true });
  try {
    const report = await runDemo({
      rollouts: ctx.invocation.rolloutCount,
      tools: ctx.invocation.demoTools,
      workDir,
      io: ctx.io,
      progress: (line) => ctx.progress(line),
    });
    return {
      exitCode: report.ok ? ExitCode.OK : ExitCode.FAILURE,
      data: { ...report, work_dir: given ? workDir : null },
      text: [
        demoTable(report),
        '',
        report.ok
          ? `OK: every rollout finished exactly once with reward 1.0; no delivered model call was repeated (checkpoint ${report.checkpoint_id}).`
          : `FAILED: ${report.not_exactly_once.length} rollout(s) not finished exactly once (${report.not_exactly_once.join(',')}), ${report.repeated_model_calls} repeated model call(s); rewards: ${JSON.stringify(report.rewards)}`,
      ].join('\n'),
    };
  } finally {
    if (!given) rmSync(workDir, { recursive: true, force: true });
  }
}
