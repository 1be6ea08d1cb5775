/** What a set of participants still tracks, read from their status replies. */

/** A participant's status reply (core's `StatusReply`), read loosely. */
export interface Status extends Record<string, unknown> {
  kind: string;
  phase: string;
  retired_rollouts: number;
  report: { blocker_count?: number; blockers?: string[]; counts?: Record<string, number> };
}

/**
 * What each server still tracks: its non-zero readiness counts, restored episodes no request
 * claimed, and retired marks. Empty when every server is idle and clean.
 */
export function tracked(statuses: Record<string, Status>): Record<string, Record<string, number>> {
  const out: Record<string, Record<string, number>> = {};
  for (const [name, status] of Object.entries(statuses)) {
    const left: Record<string, number> = {};
    for (const [key, value] of Object.entries(status.report.counts ?? {}))
      if (value !== 0) left[key] = value;
    if (status.retired_rollouts !== 0) left.retired_rollouts = status.retired_rollouts;
    if (typeof status.retired_sessions === 'number' && status.retired_sessions !== 0)
      left.retired_sessions = status.retired_sessions;
    const pending = status.restored_pending;
    if (Array.isArray(pending) && pending.length > 0) left.restored_pending = pending.length;
    if (status.phase !== 'idle') left[`phase_${status.phase}`] = 1;
    if (Object.keys(left).length > 0) out[name] = left;
  }
  return out;
}
