/**
 * The collection's progress on stderr: a bar with rate and ETA on a terminal, redrawn in place;
 * otherwise one line each time another tenth is done. The counts are clamped, so whatever a
 * caller passes (more done than total, a total of 0) draws a line and never throws.
 */
const BAR_WIDTH = 30;

export interface ProgressState {
  readonly done: number;
  readonly total: number;
  readonly inFlight: number;
  /** Rows finished by this process (a resumed run's earlier rows are not in its rate). */
  readonly doneHere: number;
  readonly elapsedSeconds: number;
}

const clamp = (n: number, low: number, high: number) =>
  Math.min(high, Math.max(low, Number.isFinite(n) ? n : low));

/** `1m05s`, `42s`. */
export function formatDuration(seconds: number): string {
  const s = Math.round(clamp(seconds, 0, Number.MAX_SAFE_INTEGER));
  return s >= 60 ? `${Math.floor(s / 60)}m${String(s % 60).padStart(2, '0')}s` : `${s}s`;
}

export function progressLine(state: ProgressState, withRate: boolean): string {
  const total = Math.max(0, Math.floor(state.total));
  const done = clamp(state.done, 0, total);
  const filled = total === 0 ? BAR_WIDTH : Math.round((done / total) * BAR_WIDTH);
  const bar = `[${'#'.repeat(filled)}${'.'.repeat(BAR_WIDTH - filled)}]`;
  const line = `${bar} ${done}/${total} done, ${clamp(state.inFlight, 0, total)} in flight`;
  if (!withRate) return line;
  const rate =
    state.elapsedSeconds > 0 ? clamp(state.doneHere, 0, total) / state.elapsedSeconds : 0;
  const eta = rate > 0 ? formatDuration((total - done) / rate) : '?';
  return `${line}, ${rate.toFixed(2)}/s, ETA ${done === total ? '0s' : eta}`;
}

/** The tenth of the way `done` is at (0…10); a line is printed each time it grows. */
export function tenth(done: number, total: number): number {
  if (total <= 0) return 10;
  return Math.floor((clamp(done, 0, total) / total) * 10);
}
