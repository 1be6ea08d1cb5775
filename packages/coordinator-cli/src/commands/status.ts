/**
 * `status`: every gym server of the stack, participant or not, and what its status says (the
 * workers of a server that runs several too). `status --watch`: the same, refreshed every second
 * until Ctrl-C.
 */
import { setTimeout as delay } from 'node:timers/promises';

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
import {
  type ServerStatus,
  type WatchedServer,
  watchedServer,
  watchFrame,
  watchJsonLine,
  watchLine,
  workersTable,
} from '../status-view.js';
import { untilSignal } from './stack.js';

/** How often `--watch` asks every server again. */
export const WATCH_INTERVAL_MS = 1000;

/** Every gym server's status (inference backends excepted), side by side. */
async function statusRows(ctx: CommandContext): Promise<ServerStatus[]> {
  const targets = [...ctx.stack.servers.values()].filter((server) => server.kind !== 'inference');
  const timeoutMs = replyTimeoutMs(ctx.nowSeconds() + ctx.probeTimeoutSeconds());
  return Promise.all(
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
}

export async function statusCommand(ctx: CommandContext): Promise<CommandResult> {
  if (ctx.invocation.watch) return watchStatus(ctx);
  const rows = await statusRows(ctx);
  const failures = Object.fromEntries(
    rows.filter((row) => row.error !== undefined).map((row) => [row.server, row.error as string]),
  );
  const failed = Object.keys(failures).length > 0;
  const now = ctx.nowSeconds();
  const workers = workersTable(rows.map(watchedServer));
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
    ...(workers === '' ? [] : ['', 'workers:', workers]),
    ...(failed ? ['', 'unreachable or failing:', failureTable(failures)] : []),
  ].join('\n');
  return {
    exitCode: failed ? ExitCode.FAILURE : ExitCode.OK,
    data: { config: ctx.configPath, servers: rows },
    text,
  };
}

/** Clears a terminal and puts the cursor home, so each frame replaces the one before. */
const CLEAR_SCREEN = '\x1b[2J\x1b[H';

/**
 * Every second, every server once more: a frame on a terminal, else one line a refresh (JSON with
 * `--json`). A server that fails is shown as failing and asked again; Ctrl-C ends with exit 0.
 */
async function watchStatus(ctx: CommandContext): Promise<CommandResult> {
  const signal = untilSignal();
  const stopped = new AbortController();
  const received = signal.received.then(() => {
    stopped.abort();
    return undefined;
  });
  let refreshes = 0;
  try {
    while (!stopped.signal.aborted) {
      const started = Date.now();
      const rows = await Promise.race([statusRows(ctx), received]);
      if (rows === undefined) break;
      ctx.io.stdout.write(`${watchOutput(ctx, new Date(), rows.map(watchedServer))}\n`);
      refreshes += 1;
      const left = WATCH_INTERVAL_MS - (Date.now() - started);
      await delay(Math.max(0, left), undefined, { signal: stopped.signal }).catch(() => undefined);
    }
  } finally {
    signal.cancel();
  }
  return {
    exitCode: ExitCode.OK,
    data: { config: ctx.configPath, refreshes },
    text: '',
    streamed: true,
  };
}

/** One refresh: a JSON line with `--json`, a frame on a terminal, else a text line. */
function watchOutput(ctx: CommandContext, at: Date, servers: readonly WatchedServer[]): string {
  if (ctx.invocation.json) return watchJsonLine(at, servers);
  if ((ctx.io.stdout as { isTTY?: boolean }).isTTY !== true) return watchLine(at, servers);
  const title = `${ctx.configPath} at ${at.toISOString()} (Ctrl-C exits)`;
  return `${CLEAR_SCREEN}${watchFrame(title, servers)}`;
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
