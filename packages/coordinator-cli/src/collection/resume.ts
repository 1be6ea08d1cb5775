/**
 * Which rows a resumed collection restores, which it retires and restarts, and the attempt each
 * is sent as (NeMo Gym's #3893 rules). Pure: the dispatch log and the latest manifest in, a plan out.
 *
 * A run is a sequence of legs (the first run, then one per `--resume`); each leg's dispatch log
 * starts with `{run_id, leg}`, then every attempt it sends, appended before the send. A leg
 * restores a checkpoint only if the previous leg published it: a leg that crashed before its
 * own first checkpoint may have sent the rows of an older checkpoint again, so those start over.
 */
import { type EpisodeId, parseCaptureKey } from '@ckpt-gym/core/protocol';

export interface LogHead {
  readonly run_id: string;
  /** 0 for the first run, one more for each resume. */
  readonly leg: number;
}

export interface DispatchLog extends LogHead {
  /** The highest attempt the leg logged, by rollout id. */
  readonly attempts: ReadonlyMap<string, number>;
}

/** `<checkpoint>/collection.json`: what the collection published with a checkpoint. */
export interface CollectionManifest extends LogHead {
  readonly checkpoint_id: string;
  /** Epoch seconds. */
  readonly created_at: number;
  /** The rows the checkpoint continues, at their committed attempt. */
  readonly continued: readonly EpisodeId[];
  /** Rows in flight that some server could not capture: they start over after a crash. */
  readonly restarted: readonly EpisodeId[];
}

export interface ResumePlan {
  /** Restored from the checkpoint (at their committed attempt), then sent as the next attempt. */
  readonly continued: EpisodeId[];
  /** Attempts the previous leg may have sent: retired everywhere, then restarted one later. */
  readonly fenced: EpisodeId[];
  /** The attempt to send each unfinished row as. */
  readonly sendAs: Map<string, number>;
  /** This leg's log starts with these, before anything is retired, restored or sent. */
  readonly carried: EpisodeId[];
  /** Why the latest checkpoint is not restored, when there is one and it is not. */
  readonly stale?: string;
}

export function logHeadLine(head: LogHead): string {
  return `${JSON.stringify({ run_id: head.run_id, leg: head.leg })}\n`;
}

export function logLine(episode: EpisodeId): string {
  return `${JSON.stringify({ rollout_id: episode.rollout_id, attempt: episode.attempt })}\n`;
}

/** Reads a dispatch log; a torn last line (a leg killed mid-write) is skipped. */
export function parseDispatchLog(text: string, where: string): DispatchLog | undefined {
  const lines = text.split('\n').filter((line) => line.trim() !== '');
  if (lines.length === 0) return undefined;
  const head = safeJson(lines[0]!) as Partial<LogHead> | undefined;
  if (typeof head?.run_id !== 'string' || typeof head.leg !== 'number') {
    throw new Error(`${where}: its first line is not {"run_id", "leg"}`);
  }
  const attempts = new Map<string, number>();
  for (const line of lines.slice(1)) {
    const entry = safeJson(line) as Partial<EpisodeId> | undefined;
    if (typeof entry?.rollout_id !== 'string' || typeof entry.attempt !== 'number') continue;
    attempts.set(entry.rollout_id, Math.max(entry.attempt, attempts.get(entry.rollout_id) ?? -1));
  }
  return { run_id: head.run_id, leg: head.leg, attempts };
}

function safeJson(line: string): unknown {
  try {
    return JSON.parse(line);
  } catch {
    return undefined;
  }
}

/**
 * The plan for the `unfinished` rows (every row without an outcome) given the previous leg's
 * log and the latest published manifest. A row the previous leg logged has that attempt retired
 * and starts over one attempt later, unless the previous leg's checkpoint continues it: then it
 * is restored and sent as its next attempt. Every attempt a restore installs is carried into the
 * new log, so a crash of this leg before its first checkpoint retires it too and never reuses it.
 */
export function planResume(
  unfinished: readonly string[],
  log: DispatchLog,
  manifest: CollectionManifest | undefined,
): ResumePlan {
  const stale = manifest && staleReason(log, manifest);
  const wanted = new Set(unfinished);
  const continued =
    manifest && stale === undefined
      ? manifest.continued.filter((e) => wanted.has(e.rollout_id))
      : [];
  const restored = new Set(continued.map((e) => e.rollout_id));
  const fenced: EpisodeId[] = [];
  for (const id of unfinished) {
    const logged = log.attempts.get(id);
    if (logged !== undefined && !restored.has(id)) fenced.push({ rollout_id: id, attempt: logged });
  }
  const sendAs = new Map(unfinished.map((id) => [id, 0]));
  for (const e of [...fenced, ...continued]) sendAs.set(e.rollout_id, e.attempt + 1);
  const carried = [
    ...fenced,
    ...continued.map((e) => ({ rollout_id: e.rollout_id, attempt: e.attempt + 1 })),
  ];
  return { continued, fenced, sendAs, carried, ...(stale === undefined ? {} : { stale }) };
}

function staleReason(log: DispatchLog, manifest: CollectionManifest): string | undefined {
  if (manifest.run_id !== log.run_id) return `it is run ${manifest.run_id}'s, not ${log.run_id}'s`;
  if (manifest.leg !== log.leg) {
    return `leg ${manifest.leg} published it and leg ${log.leg} ran after it`;
  }
  return undefined;
}

/**
 * A restore that failed: the attempts it would have installed (committed + 1) are retired
 * everywhere (core's restore retires them where it succeeded; a retire is idempotent), and the
 * rows start over from their input one attempt after those.
 */
export function restartAfterFailedRestore(continued: readonly EpisodeId[]): {
  retire: EpisodeId[];
  sendAs: Map<string, number>;
} {
  return {
    retire: continued.map((e) => ({ rollout_id: e.rollout_id, attempt: e.attempt + 1 })),
    sendAs: new Map(continued.map((e) => [e.rollout_id, e.attempt + 2])),
  };
}

/** The manifest a checkpoint's controller record stands for, published by leg `head`. */
export function collectionManifest(
  head: LogHead,
  record: { checkpoint_id: string; episode_ids: readonly string[]; restarts: readonly string[] },
  createdAt: number,
): CollectionManifest {
  return {
    checkpoint_id: record.checkpoint_id,
    run_id: head.run_id,
    leg: head.leg,
    created_at: createdAt,
    continued: record.episode_ids.map(parseCaptureKey),
    restarted: record.restarts.map(parseCaptureKey),
  };
}

/** Reads `collection.json`; anything else than a manifest is an error naming `where`. */
export function parseCollectionManifest(text: string, where: string): CollectionManifest {
  const value = safeJson(text) as Partial<CollectionManifest> | undefined;
  const episodes = (list: unknown): list is EpisodeId[] =>
    Array.isArray(list) &&
    list.every(
      (e: Partial<EpisodeId>) => typeof e?.rollout_id === 'string' && typeof e.attempt === 'number',
    );
  if (
    typeof value?.checkpoint_id !== 'string' ||
    typeof value.run_id !== 'string' ||
    typeof value.leg !== 'number' ||
    typeof value.created_at !== 'number' ||
    !episodes(value.continued) ||
    !episodes(value.restarted)
  ) {
    throw new Error(`${where} is not a collection manifest`);
  }
  return value as CollectionManifest;
}
