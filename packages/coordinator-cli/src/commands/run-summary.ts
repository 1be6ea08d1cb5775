/**
 * What `run` reports: exit 75 after a SIGTERM stop; else exit 0 only when every row sent got a
 * reply and no capture failed (a failed capture's tokens cannot train: never a silent success).
 */
import { captureKey } from '@ckpt-gym/core/protocol';

import type { Outputs } from '../collection/outputs.js';
import { ExitCode } from '../exit-codes.js';
import { type CommandResult, table } from '../output.js';
import type { Leg, LegOutcome } from './run-leg.js';

export function runSummary(parts: {
  input: string;
  output: Outputs;
  dir: string;
  leg: Leg;
  total: number;
  outcome: LegOutcome;
}): CommandResult {
  const { leg, outcome, total } = parts;
  const data = {
    run_id: leg.head.run_id,
    leg: leg.head.leg,
    input: parts.input,
    output: parts.output.path,
    failures_output: parts.output.failuresPath ?? null,
    checkpoint_dir: parts.dir,
    restored_from: leg.restoredFrom,
    total,
    written: outcome.written,
    failed: outcome.failed,
    finished: outcome.finished,
    checkpoints: outcome.checkpoints,
    lost: outcome.lost.map((l) => ({ episode_id: l.episode, reason: l.reason })),
    capture_failures: outcome.captureFailed.map((c) => ({
      episode_id: { rollout_id: c.episode.rollout_id, attempt: c.episode.attempt },
      failures: c.failures,
    })),
  };
  const progress = `${outcome.finished}/${total} finished (run ${leg.head.run_id})`;
  if (outcome.stoppedAt !== undefined) {
    return {
      exitCode: ExitCode.COLLECTION_STOPPED,
      data: { ...data, stopped_at: outcome.stoppedAt },
      text:
        `stopped ${outcome.stoppedAt === null ? 'after a checkpoint that FAILED' : `after checkpoint ${outcome.stoppedAt}`}: ` +
        `${progress}; continue with --resume after the stack is back`,
    };
  }
  const sidecar = parts.output.failuresPath;
  const lostRows = outcome.lost.map((l) => [captureKey(l.episode), l.reason]);
  const captureRows = outcome.captureFailed.map((c) => [
    captureKey(c.episode),
    c.failures.join('; '),
  ]);
  const ok = lostRows.length === 0 && captureRows.length === 0;
  return {
    exitCode: ok ? ExitCode.OK : ExitCode.FAILURE,
    data,
    text: [
      `${outcome.written} outcome(s) written to ${parts.output.path}` +
        (outcome.failed > 0
          ? `, ${outcome.failed} of them failures${sidecar === undefined ? '' : ` (in ${sidecar})`}`
          : '') +
        `; ${progress}`,
      ...(lostRows.length > 0 ? ['', 'no reply for:', table(['EPISODE', 'WHY'], lostRows)] : []),
      ...(captureRows.length > 0
        ? ['', 'token capture FAILED for:', table(['EPISODE', 'LINEAGE ROWS'], captureRows)]
        : []),
    ].join('\n'),
  };
}
