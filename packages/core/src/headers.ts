/** The data-plane headers of the checkpoint protocol (SPEC §4). */

/** On a seed reply: this server cannot capture the episode, so it is a restart. Value `1`. */
export const CHECKPOINT_RESTART_HEADER = 'x-ng-checkpoint-restart';
/** On a resources seed reply: whether its `/verify` may run again after a crash (`wait` | `replay`). */
export const CHECKPOINT_VERIFY_HEADER = 'x-ng-checkpoint-verify';
/** On a replayable `/verify` whose caller closes the session afterwards. Value `1`. */
export const CHECKPOINT_CLOSE_FOLLOWS_HEADER = 'x-ng-checkpoint-close-follows';
/** On an agent activation: its 1-based index, which makes activations idempotent. */
export const AGENT_ACTIVATION_HEADER = 'x-ng-agent-activation';
