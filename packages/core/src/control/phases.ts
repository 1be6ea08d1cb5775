/**
 * The participant phase machine as pure rules: which operation is allowed in which phase, and
 * the order in which a request is fenced. The control plane applies them under its lock.
 *
 *   idle → preparing → prepared → committed;  idle → restored;  any → idle on resume or lease expiry.
 */
import {
  CheckpointConflictError,
  type CkptGymError,
  InvalidPhaseError,
  StaleCheckpointError,
} from '../errors.js';

export const PHASES = ['idle', 'preparing', 'prepared', 'committed', 'restored'] as const;
export type Phase = (typeof PHASES)[number];

/** The operations that carry a checkpoint id and are fenced by `admissionError`. */
export type FencedOperation = 'prepare' | 'commit' | 'restore' | 'renew' | 'resume';

const OPEN: readonly Phase[] = ['preparing', 'prepared', 'committed', 'restored'];

/** Operation × phase: where each fenced operation may run. */
export const ALLOWED_PHASES: Readonly<Record<FencedOperation, readonly Phase[]>> = {
  prepare: ['idle', 'preparing'],
  commit: ['prepared'],
  restore: ['idle'],
  renew: OPEN,
  resume: OPEN,
};

/** Retire and forget run only outside a checkpoint: stopping an episode waits for calls resume releases. */
export const OUTSIDE_CHECKPOINT_PHASES: readonly Phase[] = ['idle', 'restored'];

export interface PhaseState {
  readonly phase: Phase;
  /** Null exactly when the phase is idle. */
  readonly checkpointId: string | null;
}

/**
 * Why `op` for `checkpointId` is refused in `state`, or undefined when it is admitted. The order
 * matters: a resumed id is stale before anything else, so a delayed request of a finished
 * checkpoint never disturbs the one that followed it.
 */
export function admissionError(
  op: FencedOperation,
  state: PhaseState,
  checkpointId: string,
  isResumed: (id: string) => boolean,
): CkptGymError | undefined {
  if (isResumed(checkpointId)) {
    return new StaleCheckpointError(`checkpoint ${checkpointId} was already resumed`);
  }
  if (state.checkpointId !== null && state.checkpointId !== checkpointId) {
    return new CheckpointConflictError(
      `checkpoint ${state.checkpointId} is active in phase ${state.phase}; ${op} of ${checkpointId} refused`,
    );
  }
  if (!ALLOWED_PHASES[op].includes(state.phase)) {
    return new InvalidPhaseError(`${op} is not valid in phase ${state.phase}`);
  }
  return undefined;
}

/**
 * Retire and forget: refused while a checkpoint is open, and fenced against another active
 * checkpoint. The resumed-id memory is not consulted and an idle participant takes any id, because
 * a failed restore's rollback retires under the restore's id on participants that never admitted it.
 */
export function outsideCheckpointError(
  op: 'retire' | 'forget',
  state: PhaseState,
  checkpointId: string,
): CkptGymError | undefined {
  if (!OUTSIDE_CHECKPOINT_PHASES.includes(state.phase)) {
    return new InvalidPhaseError(`${op} is not valid in phase ${state.phase}; resume first`);
  }
  if (state.checkpointId !== null && state.checkpointId !== checkpointId) {
    return new CheckpointConflictError(
      `checkpoint ${state.checkpointId} is active; ${op} under ${checkpointId} refused`,
    );
  }
  return undefined;
}

export type ResumeAction =
  /** Reopen admission left closed by a failed restore or prepare; not a no-op. */
  | 'finish-reopen'
  /** Nothing to reopen: answer `idempotent: true`, remembering the id when it is new. */
  | 'idempotent'
  /** End the open checkpoint. */
  | 'reopen';

/**
 * What a resume does. A pending reopen wins over everything, so a failed rollback is retried
 * instead of being answered as a no-op; a resumed id is idempotent; an idle participant remembers
 * the id so a delayed prepare of it is fenced.
 */
export function resumeAction(
  state: PhaseState,
  checkpointId: string,
  isResumed: (id: string) => boolean,
  reopenPending: boolean,
): ResumeAction | CkptGymError {
  if (state.phase === 'idle' && reopenPending) return 'finish-reopen';
  if (isResumed(checkpointId)) return 'idempotent';
  if (state.phase === 'idle') return 'idempotent';
  return admissionError('resume', state, checkpointId, () => false) ?? 'reopen';
}

/** The lease never moves earlier: `max(current, deadline + grace)`. */
export function extendedLease(
  current: number | null,
  deadlineTs: number,
  graceSeconds: number,
): number {
  return Math.max(current ?? 0, deadlineTs + graceSeconds);
}
