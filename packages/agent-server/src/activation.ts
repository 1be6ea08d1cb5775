/**
 * The activation index rules (`x-ng-agent-activation`): an environment server that may invoke an
 * activation again after a restore sends its 1-based index, so the agent can answer a completed
 * activation with its stored reply instead of running the loop twice.
 */
import { ActivationOutOfOrderError, CheckpointError } from '@ckpt-gym/core/protocol';

/** What the session holds that the rules look at. */
export interface ActivationView {
  readonly sessionId: string;
  readonly completedActivation: number;
  readonly hasStoredReply: boolean;
  /** The index of the activation running now (null for none, or one started without an index). */
  readonly runningIndex: number | null;
  readonly running: boolean;
}

export type ActivationDecision =
  /** Run a new activation with this index (null: no header, the next one). */
  | { kind: 'new'; index: number | null }
  /** Answer with the stored reply of the completed activation; run nothing. */
  | { kind: 'replay' }
  /** The activation is still running: wait for it to end, then decide again. */
  | { kind: 'wait' };

export function decideActivation(view: ActivationView, index: number | null): ActivationDecision {
  if (index === null) {
    if (view.running) {
      throw new CheckpointError(
        `agent session '${view.sessionId}' already has an active activation`,
      );
    }
    return { kind: 'new', index: null };
  }
  if (view.running && view.runningIndex === index) return { kind: 'wait' };
  if (index === view.completedActivation && !view.running) {
    if (!view.hasStoredReply) {
      throw new ActivationOutOfOrderError(
        `activation ${index} of agent session '${view.sessionId}' completed but its reply was not kept`,
      );
    }
    return { kind: 'replay' };
  }
  if (index !== view.completedActivation + 1) {
    throw new ActivationOutOfOrderError(
      `activation ${index} of agent session '${view.sessionId}' is out of order: activation ${view.completedActivation} is the last one completed`,
    );
  }
  if (view.running) {
    throw new CheckpointError(`agent session '${view.sessionId}' already has an active activation`);
  }
  return { kind: 'new', index };
}

/**
 * The activation count after starting one: an activation continued from a restored boundary keeps
 * the count it had; otherwise the header's index, or one more than before.
 */
export function nextActivationCount(
  current: number,
  index: number | null,
  continuesRestored: boolean,
): number {
  if (continuesRestored) return current;
  return index ?? current + 1;
}

/** `root` for the first activation, then `activation-<n>`. */
export function invocationId(activations: number): string {
  return activations > 1 ? `activation-${activations}` : 'root';
}
