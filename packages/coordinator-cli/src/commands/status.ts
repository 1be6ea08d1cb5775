/** `status`: every gym server of the stack, participant or not, and what its status says. */
import { ControlHttpError, getControl, replyTimeoutMs } from '@ckpt-gym/core/client';
import { serverUrl } from '@ckpt-gym/core/server';

import { type CommandContext, describe, statusUrl } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import {
  type CommandResult,
  failureTable,
  formatCounts,
  formatLease,
  stringList,
  table,
} from '../output.js';

interface ServerStatus {
  server: string;
  kind: string;
  url: string | null;
  /** False when the server answers 404: checkpoint routes are not installed. */
  participant: boolean;
  status?: Record<string, unknown>;
  error?: string;
}

export async function statusCommand(ctx: CommandContext): Promise<CommandResult> {
  const targets = [...ctx.stack.servers.values()].filter((server) => server.kind !== 'inference');
  const timeoutMs = replyTimeoutMs(ctx.nowSeconds() + ctx.probeTimeoutSeconds());
  const rows = await Promise.all(
    targets.map(async ({ name, kind }): Promise<ServerStatus> => {
      let url: string | null = null;
      try {
        url = serverUrl(ctx.stack, name);
        const status = await getControl(ctx.clients.control, statusUrl(url), {
          token: ctx.token,
          timeoutMs,
        });
        return { server: name, kind, url, participant: true, status };
      } catch (err) {
        if (err instanceof ControlHttpError && err.status === 404) {
          return { server: name, kind, url, participant: false };
        }
        return { server: name, kind, url, participant: false, error: describe(err) };
      }
    }),
  );
  const failures = Object.fromEntries(
    rows.filter((row) => row.error !== undefined).map((row) => [row.server, row.error as string]),
  );
  const failed = Object.keys(failures).length > 0;
  const now = ctx.nowSeconds();
  const text = [
    `${ctx.configPath}:`,
    table(
      [
        'SERVER',
        'KIND',
        'PHASE',
        'CHECKPOINT',
        'LEASE',
        'RETIRED',
        'READY',
        'BLOCKERS',
        'RESTARTS',
        'COUNTS',
      ],
      rows.map((row) => [row.server, row.kind, ...statusCells(row, now)]),
    ),
    ...(failed ? ['', 'unreachable or failing:', failureTable(failures)] : []),
  ].join('\n');
  return {
    exitCode: failed ? ExitCode.FAILURE : ExitCode.OK,
    data: { config: ctx.configPath, servers: rows },
    text,
  };
}

function statusCells(row: ServerStatus, now: number): string[] {
  if (row.error !== undefined) return ['error', '', '', '', '', '', '', ''];
  if (!row.status) return ['not a participant', '', '', '', '', '', '', ''];
  const status = row.status;
  const report = (status.report ?? {}) as Record<string, unknown>;
  const blockerCount = typeof report.blocker_count === 'number' ? report.blocker_count : 0;
  return [
    String(status.phase ?? '?'),
    typeof status.checkpoint_id === 'string' ? status.checkpoint_id : '-',
    formatLease(status.lease_expires_at, now),
    String(status.retired_rollouts ?? 0),
    report.ready === true ? 'yes' : 'no',
    String(blockerCount),
    String(stringList(report.restarts).length),
    formatCounts(report.counts),
  ];
}
