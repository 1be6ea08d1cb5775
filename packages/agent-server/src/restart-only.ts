/**
 * The participant of an agent without session hooks. Its rollouts are restarts: they never block
 * prepare, keep running through a checkpoint, are reported in prepare's `restarts`, and start over
 * from their input after a crash. Only a new session seed waits while a checkpoint is open.
 */
import {
  type AdmissionRequest,
  BaseParticipant,
  captureKey,
  CheckpointError,
  type CheckpointRecord,
  covers,
  type EpisodeId,
  type JsonObject,
  episodeFromRunBody,
  type PrepareReport,
  prepareReport,
  requestEpisode,
  RolloutIdRequiredError,
  StaleAttemptError,
} from '@ckpt-gym/core';
import type { Express, NextFunction, Request, Response } from 'express';

import { untilSettledOr } from './participant.js';
import { RolloutIndex } from './sessions.js';

interface Tracked {
  readonly episode: EpisodeId;
  readonly controller: AbortController;
  readonly done: Promise<void>;
}

interface Seeded {
  readonly key: string;
  readonly episode: EpisodeId;
}

/** Frees a seeded session through the agent's close hook (a sandbox it started stops there). */
export type ReleaseSession = (key: string) => Promise<void>;

export class RestartOnlyParticipant extends BaseParticipant {
  private readonly runs = new RolloutIndex<Tracked>();
  private readonly allRuns = new Set<Tracked>();
  private readonly seeds = new RolloutIndex<{ episode: EpisodeId; done: Promise<void> }>();
  private readonly seeded = new RolloutIndex<Seeded>();
  private readonly seededByKey = new Map<string, Seeded>();
  private accepting = true;
  /** Seeds waiting for resume. */
  private waiting = 0;
  private reopened: Promise<void> = Promise.resolve();
  private reopen: () => void = () => undefined;

  constructor(
    instance: string,
    private readonly release: ReleaseSession,
  ) {
    super('agent', instance);
  }

  async closeAdmission(_request: AdmissionRequest): Promise<void> {
    if (this.accepting) {
      this.reopened = new Promise((resolve) => {
        this.reopen = resolve;
      });
    }
    this.accepting = false;
  }

  async openAdmission(): Promise<void> {
    this.accepting = true;
    this.reopen();
  }

  ready(): boolean {
    return true;
  }

  readiness(): PrepareReport {
    const keys = new Set<string>();
    for (const run of this.allRuns) keys.add(captureKey(run.episode));
    return prepareReport({
      blockers: [],
      blockerCount: 0,
      counts: { inflight: this.allRuns.size, waiting_for_resume: this.waiting },
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

  /** Tracks one `/run` or `/v1/responses` call as a restart; a retire aborts `signal`. */
  async track<T>(episode: EpisodeId, work: (signal: AbortSignal) => Promise<T>): Promise<T> {
    this.refuseRetired(episode);
    let finish!: () => void;
    const run: Tracked = {
      episode,
      controller: new AbortController(),
      done: new Promise((r) => (finish = r)),
    };
    this.runs.add(episode.rollout_id, run);
    this.allRuns.add(run);
    try {
      return await work(run.controller.signal);
    } finally {
      this.runs.delete(episode.rollout_id, run);
      this.allRuns.delete(run);
      finish();
    }
  }

  /**
   * A session seed: waits while a checkpoint is open, then checks the retired mark; a seed whose
   * attempt was retired meanwhile frees what it built.
   */
  async seeding<T>(
    key: string,
    episode: EpisodeId,
    build: () => Promise<T>,
    signal?: AbortSignal,
  ): Promise<T> {
    this.refuseRetired(episode);
    this.waiting += 1;
    try {
      while (!this.accepting) await untilSettledOr(this.reopened, signal);
    } finally {
      this.waiting -= 1;
    }
    this.refuseRetired(episode);
    let finish!: () => void;
    const seed = { episode, done: new Promise<void>((r) => (finish = r)) };
    this.seeds.add(episode.rollout_id, seed);
    try {
      const built = await build();
      if (this.marks.isRetired(episode)) {
        await this.release(key);
        throw new StaleAttemptError(`attempt ${captureKey(episode)} was retired during its seed`);
      }
      if (!this.seededByKey.has(key)) {
        const s = { key, episode };
        this.seededByKey.set(key, s);
        this.seeded.add(episode.rollout_id, s);
      }
      return built;
    } finally {
      this.seeds.delete(episode.rollout_id, seed);
      finish();
    }
  }

  /** The session was closed: nothing to free at retire any more. */
  closed(key: string): void {
    const s = this.seededByKey.get(key);
    if (!s) return;
    this.seededByKey.delete(key);
    this.seeded.delete(s.episode.rollout_id, s);
  }

  private refuseRetired(episode: EpisodeId): void {
    if (this.marks.isRetired(episode)) {
      throw new StaleAttemptError(`attempt ${captureKey(episode)} was retired`);
    }
  }

  /** Stops the rollout's runs and waits for them and its seeds, then frees its seeded sessions. */
  async retire(episode: EpisodeId): Promise<void> {
    const rollout = episode.rollout_id;
    const runs = this.runs.of(rollout).filter((r) => covers(episode, r.episode));
    for (const r of runs)
      r.controller.abort(new StaleAttemptError(`attempt ${captureKey(r.episode)} was retired`));
    await Promise.all([
      ...runs.map((r) => r.done),
      ...this.seeds
        .of(rollout)
        .filter((s) => covers(episode, s.episode))
        .map((s) => s.done),
    ]);
    for (const s of this.seeded.of(rollout).filter((s) => covers(episode, s.episode))) {
      await this.release(s.key);
      this.closed(s.key);
    }
  }

  override statusExtra(): Record<string, unknown> {
    return { accepting: this.accepting };
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
