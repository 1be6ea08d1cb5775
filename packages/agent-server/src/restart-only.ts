/**
 * The participant of an agent without session hooks. Its rollouts are restarts: they never block
 * prepare, keep running through a checkpoint, are reported in prepare's `restarts`, and start over
 * from their input after a crash. Only a new session seed waits while a checkpoint is open.
 */
import {
  CheckpointError,
  covers,
  type EpisodeId,
  type JsonObject,
  episodeFromRunBody,
  requestEpisode,
  RolloutIdRequiredError,
} from '@ckpt-gym/core/protocol';
import {
  AdmissionGate,
  type AdmissionRequest,
  BaseParticipant,
  type CheckpointRecord,
  type PrepareReport,
  prepareReport,
} from '@ckpt-gym/core/server';
import type { Express, NextFunction, Request, Response } from 'express';

import { restartCall, runSeed, SEED } from './admission.js';
import { RolloutIndex } from './sessions.js';

interface Seeded {
  readonly key: string;
  readonly episode: EpisodeId;
}

/** Frees a seeded session through the agent's close hook (a sandbox it started stops there). */
export type ReleaseSession = (key: string) => Promise<void>;

/** The gate's tag of a tracked `/run` or `/v1/responses` call. */
const RUN = 'run';

export class RestartOnlyParticipant extends BaseParticipant {
  /** Seeds wait here while a checkpoint is open; runs and seeds are its tickets. */
  readonly gate = new AdmissionGate();
  private readonly seeded = new RolloutIndex<Seeded>();
  private readonly seededByKey = new Map<string, Seeded>();

  constructor(
    instance: string,
    private readonly release: ReleaseSession,
  ) {
    super('agent', instance);
  }

  async closeAdmission(_request: AdmissionRequest): Promise<void> {
    this.gate.close();
  }

  async openAdmission(): Promise<void> {
    this.gate.open();
  }

  ready(): boolean {
    return true;
  }

  readiness(): PrepareReport {
    const keys = new Set<string>();
    for (const run of this.gate.tickets(RUN)) keys.add(run.key);
    return prepareReport({
      blockers: [],
      blockerCount: 0,
      counts: { inflight: this.gate.count(RUN), waiting_for_resume: this.gate.waiting },
      restarts: [...keys].sort(),
    });
  }

  async export(): Promise<CheckpointRecord[]> {
    return [];
  }

  validateRecord(record: JsonObject, key: string): CheckpointRecord {
    throw new CheckpointError(
      `${key}: a restart-only agent cannot restore rollouts (${Object.keys(record).length} fields)`,
    );
  }

  async install(records: CheckpointRecord[]): Promise<void> {
    if (records.length > 0)
      throw new CheckpointError('a restart-only agent cannot restore rollouts');
  }

  restoredPending(): EpisodeId[] {
    return [];
  }

  // What a worker of a server with several workers asks of its participant: nothing is restored.
  onRestoredLeft(): void {}

  sessionCopies(): { id: string; unused: boolean }[] {
    return [];
  }

  async freeUnused(): Promise<void> {}

  /** Tracks one `/run` or `/v1/responses` call as a restart; a retire aborts `signal`. */
  track<T>(episode: EpisodeId, work: (signal: AbortSignal) => Promise<T>): Promise<T> {
    return this.gate.run(restartCall(episode, RUN, this.marks), (run) => work(run.signal));
  }

  /**
   * A session seed: waits while a checkpoint is open, then checks the retired mark; a seed whose
   * attempt was retired meanwhile frees what it built.
   */
  seeding<T>(
    key: string,
    episode: EpisodeId,
    build: () => Promise<T>,
    signal?: AbortSignal,
  ): Promise<T> {
    return runSeed(this.gate, this.marks, {
      episode,
      signal,
      build,
      free: () => this.release(key),
      keep: () => {
        if (this.seededByKey.has(key)) return;
        const s = { key, episode };
        this.seededByKey.set(key, s);
        this.seeded.add(episode.rollout_id, s);
      },
    });
  }

  /** The session was closed: nothing to free at retire any more. */
  closed(key: string): void {
    const s = this.seededByKey.get(key);
    if (!s) return;
    this.seededByKey.delete(key);
    this.seeded.delete(s.episode.rollout_id, s);
  }

  /** Stops the rollout's runs and waits for them and its seeds, then frees its seeded sessions. */
  async retire(episode: EpisodeId): Promise<void> {
    await Promise.all([this.gate.retire(episode, RUN), this.gate.drain(episode, SEED)]);
    for (const s of this.seeded.of(episode.rollout_id).filter((s) => covers(episode, s.episode))) {
      await this.release(s.key);
      this.closed(s.key);
    }
  }

  override statusExtra(): Record<string, unknown> {
    return { accepting: this.gate.isOpen };
  }
}

const installed = new WeakSet<Express>();
const runSignals = new WeakMap<Request, AbortSignal>();

/** The signal a retire aborts for a request the restart-only participant tracks. */
export function restartSignal(req: Request): AbortSignal | undefined {
  return runSignals.get(req);
}

function isTrackedCall(req: Request): boolean {
  return req.method === 'POST' && (req.path === '/run' || req.path.endsWith('/v1/responses'));
}

/**
 * Installs the participant's tracking on `app` (every POST to `/run` or a path ending
 * `/v1/responses`, the agent's own routes included) once per app; returns false when it was
 * already installed. Needs the JSON body parsed first (a `/run` may name its rollout in the body).
 */
export function installRestartOnly(app: Express, participant: RestartOnlyParticipant): boolean {
  if (installed.has(app)) return false;
  installed.add(app);
  app.use((req: Request, res: Response, next: NextFunction) => {
    if (!isTrackedCall(req)) {
      next();
      return;
    }
    let episode: EpisodeId | undefined;
    try {
      episode =
        requestEpisode(req) ?? (req.path === '/run' ? episodeFromRunBody(req.body) : undefined);
    } catch (err) {
      next(err);
      return;
    }
    if (!episode) {
      next(
        new RolloutIdRequiredError(
          'checkpointing requires a rollout id on every agent call: send _ng_rollout_id or the /ng-rollout/<id> prefix',
        ),
      );
      return;
    }
    participant
      .track(episode, (signal) => {
        runSignals.set(req, signal);
        next();
        return new Promise<void>((resolve) => res.once('close', resolve));
      })
      .catch(next);
  });
  return true;
}
