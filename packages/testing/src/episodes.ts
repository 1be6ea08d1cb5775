/** Episode ids as tests write them: `ep('r1')`, `ep('r1', 2)`, or a capture key `ep('r1-a2')`. */
import { type EpisodeId, parseCaptureKey } from '@ckpt-gym/core/protocol';

/** With an attempt: that episode. Without one: the episode of capture key `key` (attempt 0 unless `-aN`). */
export function ep(key: string, attempt?: number): EpisodeId {
  return attempt === undefined ? parseCaptureKey(key) : { rollout_id: key, attempt };
}

/** The episodes of capture keys `keys`, in order. */
export function episodes(...keys: string[]): EpisodeId[] {
  return keys.map((key) => ep(key));
}
