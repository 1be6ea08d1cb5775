/**
 * The data plane's admission rules, one per server kind, as pure functions (what
 * `control/phases.ts` is for the control plane): each reads a plain state object and decides
 * whether a request is admitted now, waits for the checkpoint to resume, or is refused with a
 * catalogue error. `AdmissionGate` applies the waiting ones: it asks the rule again each time its
 * state changes, and enters the ticket in the same tick as the rule's `admit`. Rules that never
 * wait return the refusal or undefined, as `admissionError` does.
 *
 * Which rule decides whether a request waits:
 * - model (a generation call): `modelCallAdmission`;
 * - resources (a session start, close, verify or tool call): `resourcesAdmission`, whose waiting
 *   part is `resourcesWaits`;
 * - agent: `agentSeedAdmission` (a session seed), `agentCloseAdmission` (a session close),
 *   `restartCallAdmission` (a direct `/v1/responses` call, a restart-only `/run`), and
 *   `legacyRunAdmission` (a legacy `/run`, refused while closed: it never waits);
 * - environment (an episode `/run`): `episodeRunAdmission` (refused while closed: never waits).
 */
import {
  AdmissionClosedError,
  CheckpointError,
  type CkptGymError,
  RolloutIdRequiredError,
  StaleAttemptError,
} from '../errors.js';
import { captureKey, type EpisodeId, sameEpisode } from '../identity.js';

export type Decision =
  | { readonly kind: 'admit' }
  | { readonly kind: 'wait' }
  | { readonly kind: 'refuse'; readonly error: CkptGymError };

export const ADMIT: Decision = { kind: 'admit' };
export const WAIT: Decision = { kind: 'wait' };

export function refuse(error: CkptGymError): Decision {
  return { kind: 'refuse', error };
}

/** Admitted now, or waiting for admission to reopen. */
function openOrWait(open: boolean): Decision {
  return open ? ADMIT : WAIT;
}

/** The refusal of a data-plane request of a retired attempt. */
export function retiredAttempt(episode: EpisodeId): StaleAttemptError {
  return new StaleAttemptError(
    `rollout '${episode.rollout_id}' attempt ${episode.attempt} was retired`,
  );
}

/** What every admission state carries: whether a checkpoint closed admission. */
export interface OpenState {
  readonly open: boolean;
}

// --- model: a generation call ---------------------------------------------------------------

export interface ModelCallState extends OpenState {
  /** The call's capture key; undefined for an untagged call, which nothing retires. */
  readonly key: string | undefined;
  /** Its attempt is marked retired, or a mark or retire refused it while it waited (for good). */
  readonly retired: boolean;
}

/** The refusal of a generation call of a retired attempt. */
export function staleCall(key: string): StaleAttemptError {
  return new StaleAttemptError(`attempt ${key} was retired; this call is refused`);
}

/** A call waits while a checkpoint is open; a retired attempt is refused first, even while it waits. */
export function modelCallAdmission(s: ModelCallState): Decision {
  if (s.retired && s.key !== undefined) return refuse(staleCall(s.key));
  return openOrWait(s.open);
}

// --- resources: a session start, close, verify or tool call ----------------------------------

export type ResourcesRole = 'start' | 'close' | 'verify' | 'tool';
export type ResourcesMode = 'restart_only' | 'stateless' | 'exported';
export type ResourcesVerify = 'wait' | 'replay';

export interface ResourcesWaitState extends OpenState {
  readonly role: ResourcesRole;
  readonly mode: ResourcesMode;
  readonly verify: ResourcesVerify;
}

/** A `/verify` that may run again after a crash: it never waits and never holds up prepare. */
export function isReplayableVerify(role: ResourcesRole, verify: ResourcesVerify): boolean {
  return role === 'verify' && verify === 'replay';
}

/**
 * While a checkpoint is open, a session start always waits; in `restart_only` nothing else does
 * (its rollouts are restarts); otherwise everything but a replayable `/verify` waits.
 */
export function resourcesWaits(s: ResourcesWaitState): boolean {
  if (s.open) return false;
  if (s.role === 'start') return true;
  return s.mode !== 'restart_only' && !isReplayableVerify(s.role, s.verify);
}

export interface ResourcesRequestState extends ResourcesWaitState {
  /** A route name for messages. */
  readonly path: string;
  readonly sessionId: string;
  /** The attempt the `/ng-rollout` prefix names. */
  readonly episode: EpisodeId | undefined;
  readonly attemptRetired: boolean;
  /** The session belongs to a retired attempt (fenced, or remembered until forget). */
  readonly sessionRetired: boolean;
  /** The tracked session the request is on. */
  readonly session:
    { readonly key: string; readonly episode: EpisodeId; readonly restored: boolean } | undefined;
}

/**
 * In order: a start, close or verify must name its attempt; then the wait; then (a close is never
 * refused for a retire: it is how its owner frees the session) a retired session or attempt, and a
 * session owned by another attempt — or, named by the cookie alone, restored.
 */
export function resourcesAdmission(s: ResourcesRequestState): Decision {
  if (s.role !== 'tool' && s.episode === undefined) {
    return refuse(
      new RolloutIdRequiredError(
        `${s.path} needs the /ng-rollout/<capture key> prefix while checkpointing is on`,
      ),
    );
  }
  if (resourcesWaits(s)) return WAIT;
  const closing = s.role === 'close';
  if (!closing && s.sessionRetired) {
    return refuse(
      new StaleAttemptError(`resources session '${s.sessionId}' belongs to a retired attempt`),
    );
  }
  if (!closing && s.episode && s.attemptRetired) return refuse(retiredAttempt(s.episode));
  const { session } = s;
  if (!session || s.role === 'start') return ADMIT;
  if (s.episode === undefined) {
    // The cookie alone cannot tell the replacement from the attempt the restore replaced.
    if (!session.restored) return ADMIT;
    return refuse(
      new RolloutIdRequiredError(
        `resources session '${s.sessionId}' was restored; name its attempt with the /ng-rollout/<capture key> prefix`,
      ),
    );
  }
  if (sameEpisode(s.episode, session.episode)) return ADMIT;
  return refuse(
    new StaleAttemptError(
      `resources session '${s.sessionId}' belongs to attempt ${session.key}, not ${captureKey(s.episode)}`,
    ),
  );
}

// --- agent: seeds, closes, direct calls and legacy runs --------------------------------------

export interface AttemptState {
  readonly episode: EpisodeId;
  readonly retired: boolean;
}

/** The refusal of an agent request of a retired attempt. */
function retiredAgentAttempt(episode: EpisodeId): StaleAttemptError {
  return new StaleAttemptError(`attempt ${captureKey(episode)} was retired`);
}

/** A session seed: a retired attempt is refused, before and after its wait; it waits while closed. */
export function agentSeedAdmission(s: AttemptState & OpenState): Decision {
  if (s.retired) return refuse(retiredAgentAttempt(s.episode));
  return openOrWait(s.open);
}

/** A session close waits while a checkpoint is open (the session's owner checks the rest). */
export function agentCloseAdmission(s: OpenState): Decision {
  return openOrWait(s.open);
}

/**
 * A call run as a restart (a direct `/v1/responses` under a rollout path, a restart-only agent's
 * `/run`): never waits, since restarts run through a checkpoint; a retired attempt is refused.
 */
export function restartCallAdmission(s: AttemptState): Decision {
  return s.retired ? refuse(retiredAgentAttempt(s.episode)) : ADMIT;
}

export interface LegacyRunState extends AttemptState, OpenState {
  /** `run:<rollout_id>`. */
  readonly key: string;
  /** The session already under `key`, if any. */
  readonly existing:
    | { readonly episode: EpisodeId; readonly restoredPending: boolean; readonly retired: boolean }
    | undefined;
}

/**
 * A legacy `/run` continues the restored session of its own attempt; any other session under its
 * key is another attempt's (`stale_attempt`) or already running. A new one is refused while a
 * checkpoint is open: only seeds wait for resume.
 */
export function legacyRunAdmission(s: LegacyRunState): CkptGymError | undefined {
  if (s.retired) return retiredAgentAttempt(s.episode);
  const { existing } = s;
  if (existing) {
    const same = sameEpisode(existing.episode, s.episode);
    if (existing.restoredPending && same) return undefined;
    return existing.retired || !same
      ? new StaleAttemptError(
          `legacy run ${s.key} belongs to attempt ${captureKey(existing.episode)}`,
        )
      : new CheckpointError(`legacy run ${s.key} is already running`);
  }
  if (!s.open)
    return new AdmissionClosedError(`legacy run ${s.key} refused while a checkpoint is open`);
  return undefined;
}

// --- environment: an episode /run ------------------------------------------------------------

export interface EpisodeRunState extends AttemptState, OpenState {
  readonly key: string;
  /** The restored record the replacement continues, if any. */
  readonly restored: { readonly sameTask: boolean } | undefined;
  /** A restore installed records and the controller has not resumed yet. */
  readonly awaitingResume: boolean;
  readonly running: boolean;
}

/**
 * In order: a retired attempt; admission closed for anything but a replacement after the
 * post-restore resume; a restored record for another task; an attempt already running.
 */
export function episodeRunAdmission(s: EpisodeRunState): CkptGymError | undefined {
  if (s.retired) return retiredAttempt(s.episode);
  if (!s.open && (s.restored === undefined || s.awaitingResume)) {
    return new AdmissionClosedError('episode admission is closed for a checkpoint');
  }
  if (s.restored !== undefined && !s.restored.sameTask) {
    return new CheckpointError(
      `episode ${s.key} continues a checkpoint recorded for a different task`,
    );
  }
  if (s.running) return new CheckpointError(`episode ${s.key} is already running`);
  return undefined;
}
