/**
 * What both agent participants admit through their `AdmissionGate`, by the agent rules of core's
 * `admission/rules.ts`: a session seed waits while a checkpoint is open; a call run as a restart
 * never waits. Either is refused for a retired attempt.
 */
import { captureKey, type EpisodeId, StaleAttemptError } from '@ckpt-gym/core/protocol';
import {
  type AdmissionGate,
  type AdmitOptions,
  agentSeedAdmission,
  restartCallAdmission,
  type RetiredMarks,
} from '@ckpt-gym/core/server';

/** The gate's tag of a session seed (a retire waits for it, never aborts it). */
export const SEED = 'seed';

/** A session seed of `episode`: refused when retired, before and after it waits for resume. */
function seedAdmission(
  episode: EpisodeId,
  marks: RetiredMarks,
  signal: AbortSignal | undefined,
): AdmitOptions {
  return {
    episode,
    signal,
    tag: SEED,
    rule: (gate) =>
      agentSeedAdmission({ open: gate.open, episode, retired: marks.isRetired(episode) }),
  };
}

/** A call of `episode` run as a restart under `tag` (a retire aborts it and waits for it). */
export function restartCall(episode: EpisodeId, tag: string, marks: RetiredMarks): AdmitOptions {
  return {
    episode,
    tag,
    rule: () => restartCallAdmission({ episode, retired: marks.isRetired(episode) }),
  };
}

export interface Seed<T> {
  readonly episode: EpisodeId;
  readonly signal: AbortSignal | undefined;
  readonly build: () => Promise<T>;
  /** Frees what `build` built, when the attempt was retired meanwhile. */
  readonly free: () => Promise<void>;
  /** Records the seeded session; runs while the seed still holds its ticket. */
  readonly keep: () => void;
}

/**
 * Runs a session seed under a ticket of `gate` (a retire waits for it): admitted by the seed rule,
 * it builds, then frees what it built and is `stale_attempt` if its attempt was retired meanwhile.
 */
export async function runSeed<T>(
  gate: AdmissionGate,
  marks: RetiredMarks,
  seed: Seed<T>,
): Promise<T> {
  const ticket = await gate.admit(seedAdmission(seed.episode, marks, seed.signal));
  try {
    const built = await seed.build();
    if (marks.isRetired(seed.episode)) {
      await seed.free();
      throw new StaleAttemptError(
        `attempt ${captureKey(seed.episode)} was retired during its seed`,
      );
    }
    seed.keep();
    return built;
  } finally {
    gate.leave(ticket);
  }
}
