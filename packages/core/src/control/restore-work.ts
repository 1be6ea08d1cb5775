/**
 * A restore's work: read the records in scope, then install them. The install is kept as a
 * promise: a restore cut short by its deadline leaves it running, and a later restore, a retire or
 * a resume awaits it instead of racing it. Each restore that closes admission takes over; only the
 * restore that took over last may reopen admission when its failed install finally ends.
 */
import { CheckpointStateError } from '../errors.js';
import type { AdmissionRequest, Participant } from '../participant.js';
import type { CheckpointRecord, Manifest } from '../store.js';
import type { Bound } from './commit-work.js';
import { Kept } from './deadline.js';
import type { OperationWatch } from './observer.js';
import type { RestoreRequest } from './schemas.js';
import type { ParticipantStorage } from './storage.js';

/** A model server's generation-cut round once admission closed, timed as its own stage. */
export async function runCutRound(
  participant: Participant,
  admission: AdmissionRequest,
  watch: OperationWatch,
): Promise<void> {
  if (participant.cutRound === undefined) return;
  await participant.cutRound(admission);
  watch.lap('cut_round');
}

export class Installs {
  #running: Kept<void> | null = null;
  #generation = 0;

  /** The latest install while it runs, else null. */
  get running(): Kept<void> | null {
    return this.#running;
  }

  /** A restore takes over; returns its generation, which `isLatest` compares. */
  takeOver(): number {
    return ++this.#generation;
  }

  isLatest(generation: number): boolean {
    return this.#generation === generation;
  }

  start(install: () => Promise<void>): Kept<void> {
    const kept = new Kept(install);
    this.#running = kept;
    void kept.settled().then(() => {
      if (this.#running === kept) this.#running = null;
    });
    return kept;
  }
}

export interface RestoreWork<R extends CheckpointRecord> {
  readonly participant: Participant<R>;
  readonly storage: ParticipantStorage<R>;
  readonly installs: Installs;
  /** Within the restore's deadline. */
  readonly bound: Bound;
  readonly watch: OperationWatch;
  /** After a failure once admission was closed: reopens it now, or once `install` ended. */
  rollBack(generation: number, install: Kept<void> | null): Promise<void>;
}

/**
 * Reads the records in `scopeKeys`, marks the attempts they replace, waits for an earlier install,
 * closes admission and installs. A checkpoint the store refuses raises no marks; anything else
 * cut short still marks them, and a failure after admission closed rolls the restore back.
 */
export async function readAndInstall<R extends CheckpointRecord>(
  req: RestoreRequest,
  scopeKeys: ReadonlySet<string>,
  work: RestoreWork<R>,
): Promise<{ source: Manifest; records: R[] }> {
  const { participant, installs, bound, watch } = work;
  let generation: number | null = null;
  let install: Kept<void> | null = null;
  try {
    const { manifest, records } = await bound(work.storage.read(req.checkpoint_dir, scopeKeys));
    watch.lap('read');
    // Once the checkpoint is accepted, before the install the deadline limits: a harness that
    // outlived the crash may still call with the attempts this restore replaces.
    participant.marks.mark(req.episode_ids);
    const earlierInstall = installs.running;
    if (earlierInstall) {
      await bound(earlierInstall.settled());
      watch.lap('install_wait');
    }
    // Taking over: an earlier failed restore no longer reopens when its install ends.
    generation = installs.takeOver();
    const admission = {
      checkpointId: req.checkpoint_id,
      deadlineTs: req.deadline_ts,
      carriedRestarts: new Set<string>(),
    };
    await participant.closeAdmission(admission);
    watch.lap('close_admission');
    await runCutRound(participant, admission, watch);
    participant.restoreManifest?.(manifest);
    install = installs.start(() => participant.install(records, req.episode_ids));
    await bound(install.promise);
    watch.lap('install');
    return { source: manifest, records };
  } catch (err) {
    if (!(err instanceof CheckpointStateError)) participant.marks.mark(req.episode_ids);
    if (generation !== null) await work.rollBack(generation, install);
    throw err;
  }
}
