/**
 * Rendering, pure: aligned tables and the small formats the commands share. Human output goes
 * through these; `--json` output is one document built by `jsonDocument`.
 */
import type { ExitCodeValue } from './exit-codes.js';

/** What a command hands back to the frame: its exit code, its JSON details, its human text. */
export interface CommandResult {
  readonly exitCode: ExitCodeValue;
  /** Merged into the JSON document after `command`, `ok` and `exit_code`. */
  readonly data: Readonly<Record<string, unknown>>;
  /** Human-readable output for stdout; ends without a newline. */
  readonly text: string;
  /** The command wrote its output as it went (`status --watch`): nothing more is printed. */
  readonly streamed?: boolean;
}

/** Columns padded to their widest cell; the last column is never padded (no trailing spaces). */
export function table(headers: readonly string[], rows: readonly (readonly string[])[]): string {
  const all = [headers, ...rows];
  const widths = headers.map((_, column) =>
    Math.max(...all.map((row) => (row[column] ?? '').length)),
  );
  return all
    .map((row) =>
      headers
        .map((_, column) => {
          const cell = row[column] ?? '';
          return column === headers.length - 1 ? cell : cell.padEnd(widths[column] ?? 0);
        })
        .join('  ')
        .trimEnd(),
    )
    .join('\n');
}

export function formatSeconds(seconds: number): string {
  return `${seconds.toFixed(3)} s`;
}

/** A list of keys, cut after `limit` with a count of the rest; `-` when empty. */
export function formatKeys(keys: readonly string[], limit = 8): string {
  if (keys.length === 0) return '-';
  const shown = keys.slice(0, limit).join(',');
  return keys.length > limit ? `${shown} (+${keys.length - limit} more)` : shown;
}

/** A lease as the time left from `now` (epoch seconds). */
export function formatLease(expiresAt: unknown, now: number): string {
  if (typeof expiresAt !== 'number') return '-';
  const left = expiresAt - now;
  return left <= 0 ? 'expired' : `${Math.round(left)} s left`;
}

/** `{episodes: 3, parked: 1}` → `episodes=3 parked=1`. */
export function formatCounts(counts: unknown): string {
  if (typeof counts !== 'object' || counts === null) return '-';
  const entries = Object.entries(counts as Record<string, unknown>);
  return entries.length === 0
    ? '-'
    : entries.map(([key, value]) => `${key}=${String(value)}`).join(' ');
}

/** A failure per server, sorted by server name. */
export function failureTable(failures: Readonly<Record<string, string>>): string {
  const servers = Object.keys(failures).sort();
  return table(
    ['SERVER', 'ERROR'],
    servers.map((server) => [server, failures[server] ?? '']),
  );
}

/** The one JSON document `--json` prints: `command`, `ok`, `exit_code`, then the details. */
export function jsonDocument(
  command: string,
  exitCode: number,
  data: Readonly<Record<string, unknown>>,
): string {
  return `${JSON.stringify({ command, ok: exitCode === 0, exit_code: exitCode, ...data }, null, 2)}\n`;
}

/** Absent or non-string entries of a reply field, as a string list. */
export function stringList(value: unknown): string[] {
  return Array.isArray(value)
    ? value.filter((item): item is string => typeof item === 'string')
    : [];
}
