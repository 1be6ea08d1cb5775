/**
 * The environment server: `POST /run` on core's gym app, with the environment participant when
 * checkpointing is on. The runner applies the episode protocol's processing order: queue
 * admission, the participant's begin checks, the episode deadline, the protocol, failure
 * classification, then final cleanup (LIFO, never interrupted by a retire) before the reply.
 */
import {
  DeadlineExceededError,
  encodeJson,
  type EpisodeRequest,
  type JsonValue,
  parseAggregateMetricsRequest,
  parseEpisodeRequest,
  StaleAttemptError,
} from '@ckpt-gym/core/protocol';
import {
  type CheckpointSettings,
  createGymApp,
  type EpisodeContext,
  type GymApp,
  gymRoute,
  type GymRoute,
  type Logger,
  mountRoutes,
  ParticipantWorker,
  type WorkerLink,
} from '@ckpt-gym/core/server';
import type { Express, Response } from 'express';

import { episodeRequestFromRow, legacyReply } from './legacy.js';
import { EnvironmentParticipant, type EnvironmentRecord } from './participant.js';
import {
  ADMISSION_TIMED_OUT_FAILURE,
  CleanupStack,
  type EnvironmentProtocol,
  type EpisodeReply,
  EpisodeQueue,
  type EpisodeWork,
  failureReply,
  HandledEpisodeError,
  resultReply,
  TIMED_OUT_FAILURE,
  taskJson,
  unhandledFailure,
} from './protocol.js';

export const DEFAULT_CLEANUP_TIMEOUT_SECONDS = 60;
export const RUN_BODY_LIMIT = '64mb';

export interface QueueOptions {
  maxConcurrentEpisodes: number;
  queueTimeoutSeconds: number;
}

export interface EpisodeRunnerOptions {
  protocol: EnvironmentProtocol;
  /** Present exactly when checkpointing is on. */
  participant?: EnvironmentParticipant;
  queue?: QueueOptions;
  /** Seconds of work per episode (time parked for a checkpoint does not count); null: none. */
  episodeDeadlineSeconds?: number | null;
  cleanupTimeoutSeconds?: number;
  logger?: Pick<Logger, 'warn'>;
}

type Outcome = { reply: EpisodeReply } | { error: unknown };

/** Runs `/run` requests in the protocol's processing order. */
export class EpisodeRunner {
  private readonly queue: EpisodeQueue | undefined;

  constructor(private readonly options: EpisodeRunnerOptions) {
    this.queue = options.queue && new EpisodeQueue(options.queue.maxConcurrentEpisodes);
  }

  async run(request: EpisodeRequest, clientSignal?: AbortSignal): Promise<EpisodeReply> {
    let release: (() => void) | null = null;
    if (this.queue) {
      release = await this.queue.acquire(this.options.queue!.queueTimeoutSeconds, clientSignal);
      if (release === null) return failureReply(request, ADMISSION_TIMED_OUT_FAILURE);
    }
    try {
      const participant = this.options.participant;
      if (participant) {
        return await participant.run(
          request.episode_id,
          taskJson(request.task),
          {
            deadlineSeconds: this.options.episodeDeadlineSeconds ?? null,
            restart: !this.options.protocol.checkpointBoundaries,
          },
          (ep) => this.episode(request, ep, clientSignal),
        );
      }
      return await this.episode(request, uncheckpointed(request, this.options), clientSignal);
    } finally {
      // Last: after final cleanup and end().
      release?.();
    }
  }

  private async episode(
    request: EpisodeRequest,
    ep: EpisodeContext,
    clientSignal: AbortSignal | undefined,
  ): Promise<EpisodeReply> {
    const signal = clientSignal ? AbortSignal.any([ep.signal, clientSignal]) : ep.signal;
    const cleanup = new CleanupStack(
      this.options.cleanupTimeoutSeconds ?? DEFAULT_CLEANUP_TIMEOUT_SECONDS,
      this.options.logger,
    );
    const work: EpisodeWork = {
      episode: request.episode_id,
      key: ep.key,
      signal,
      checkpointing: this.options.participant !== undefined,
      cleanup,
      continuation: () => ep.continuation(),
      boundary: (state) => ep.boundary(state),
      step: (mode, fn) => ep.step(mode, fn),
      markRestart: () => ep.markRestart(),
    };
    let outcome: Outcome;
    try {
      outcome = { reply: resultReply(request, await this.options.protocol.run(request, work)) };
    } catch (err) {
      outcome = classify(request, err, signal);
    } finally {
      // From here a retire waits for the episode instead of aborting it.
      ep.finishing();
      await cleanup.unwind();
    }
    if ('error' in outcome) throw outcome.error;
    return outcome.reply;
  }
}

/**
 * The reply for an episode that threw: a passed deadline is a retryable failure; a retire (or a
 * client that went away) propagates with no reply body; a handled failure is kept; anything else
 * is an unhandled, terminal failure.
 */
export function classify(request: EpisodeRequest, err: unknown, signal: AbortSignal): Outcome {
  if (signal.aborted) {
    const reason: unknown = signal.reason;
    if (reason instanceof DeadlineExceededError) {
      return { reply: failureReply(request, TIMED_OUT_FAILURE) };
    }
    return { error: reason };
  }
  if (err instanceof StaleAttemptError) return { error: err };
  if (err instanceof HandledEpisodeError) return { reply: failureReply(request, err.failure) };
  return { reply: failureReply(request, unhandledFailure(err)) };
}

/**
 * The episode context with checkpointing off: only the deadline. Boundaries are dropped unbuilt
 * and steps just run.
 */
function uncheckpointed(request: EpisodeRequest, options: EpisodeRunnerOptions): EpisodeContext {
  const controller = new AbortController();
  const seconds = options.episodeDeadlineSeconds;
  let timer: NodeJS.Timeout | undefined;
  if (seconds != null) {
    timer = setTimeout(
      () =>
        controller.abort(new DeadlineExceededError(`episode passed its deadline of ${seconds} s`)),
      seconds * 1000,
    );
  }
  return {
    key: captureKeyOf(request),
    signal: controller.signal,
    continuation: () => null,
    boundary: () => Promise.resolve(),
    step: (_mode, fn) => fn(),
    markRestart: () => Promise.resolve(),
    finishing: () => clearTimeout(timer),
  };
}

function captureKeyOf(request: EpisodeRequest): string {
  const e = request.episode_id;
  return e.attempt === 0 ? e.rollout_id : `${e.rollout_id}-a${e.attempt}`;
}

// --- the server -------------------------------------------------------------------------------

export interface EnvironmentServerOptions {
  /** The server's name (its checkpoint instance). */
  name: string;
  protocol: EnvironmentProtocol;
  /** Undefined: checkpointing off (no participant, no control routes). */
  checkpoint?: CheckpointSettings;
  /**
   * In a worker of a server with several workers: its link to the coordinator. The participant
   * then runs this worker's episodes only, and the control routes forward to the coordinator.
   */
  link?: WorkerLink | undefined;
  queue?: QueueOptions;
  episodeDeadlineSeconds?: number | null;
  cleanupTimeoutSeconds?: number;
  /** Serve `/run` as the legacy flat-row adapter; tasks default to this taskset. */
  legacy?: { defaultTaskset: string };
  logger?: Logger;
}

export interface EnvironmentServer {
  readonly app: Express;
  readonly logger: Logger;
  readonly participant: EnvironmentParticipant | undefined;
  readonly plane: GymApp<EnvironmentRecord>['plane'];
  readonly runner: EpisodeRunner;
  /** In a worker of a server with several workers: its share of the participant, to attach. */
  readonly worker: ParticipantWorker<EnvironmentRecord> | undefined;
}

export function createEnvironmentServer(options: EnvironmentServerOptions): EnvironmentServer {
  const { link } = options;
  const participant = options.checkpoint ? new EnvironmentParticipant(options.name) : undefined;
  const gym = createGymApp<EnvironmentRecord>({
    name: options.name,
    kind: 'environment',
    checkpoint: options.checkpoint,
    ...(participant && !link ? { participant } : {}),
    ...(participant && link ? { control: link.controlTarget() } : {}),
    ...(options.logger ? { logger: options.logger } : {}),
  });
  const worker =
    participant && link ? new ParticipantWorker(participant, link, gym.logger) : undefined;
  if (participant && worker) participant.claims = worker;
  const runner = new EpisodeRunner({
    protocol: options.protocol,
    ...(participant ? { participant } : {}),
    ...(options.queue ? { queue: options.queue } : {}),
    episodeDeadlineSeconds: options.episodeDeadlineSeconds ?? null,
    cleanupTimeoutSeconds: options.cleanupTimeoutSeconds ?? DEFAULT_CLEANUP_TIMEOUT_SECONDS,
    logger: gym.logger,
  });
  mountRoutes(gym.app, environmentRoutes(runner, options));
  gym.finish();
  return { app: gym.app, logger: gym.logger, participant, plane: gym.plane, runner, worker };
}

/** Answers a reply object as faithful JSON (big integers and the like kept as sent). */
function sendJson(res: Response, body: JsonValue | EpisodeReply): void {
  res.type('application/json').send(encodeJson(body));
}

/** `/run` (native, or the legacy flat-row adapter) and, when the protocol has it, `/aggregate_metrics`. */
function environmentRoutes(runner: EpisodeRunner, options: EnvironmentServerOptions): GymRoute[] {
  const legacy = options.legacy;
  const run = legacy
    ? gymRoute({
        method: 'post',
        path: '/run',
        episode: 'none',
        body: {
          limit: RUN_BODY_LIMIT,
          parse: (row) => episodeRequestFromRow(row, legacy.defaultTaskset),
        },
        run: async ({ body, signal }) => legacyReply(await runner.run(body, signal)),
        reply: sendJson,
      })
    : gymRoute({
        method: 'post',
        path: '/run',
        episode: 'none',
        body: { limit: RUN_BODY_LIMIT, parse: parseEpisodeRequest },
        run: ({ body, signal }) => runner.run(body, signal),
        reply: sendJson,
      });
  const metrics = options.protocol.aggregateMetrics?.bind(options.protocol);
  if (!metrics) return [run];
  return [
    run,
    gymRoute({
      method: 'post',
      path: '/aggregate_metrics',
      episode: 'none',
      body: { limit: RUN_BODY_LIMIT, parse: parseAggregateMetricsRequest },
      run: ({ body, signal }) => metrics(body, signal),
      reply: sendJson,
    }),
  ];
}
