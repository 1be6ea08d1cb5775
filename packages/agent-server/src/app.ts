/**
 * The agent server: agent sessions (seed, activation, close) over an agent definition, with the
 * agent participant when the agent has session hooks, a restart-only participant when it has not,
 * and nothing at all when checkpointing is off. On a worker of a server with several workers its
 * session router sends each session's requests to the worker that owns it, and with checkpointing
 * on its participant is that worker's share of the coordinator's (`SessionWorker`).
 */
import type { Express } from 'express';

import { createHttpClients, type HttpClientLimits, type HttpClients } from '@ckpt-gym/core/client';
import {
  type CheckpointRecord,
  type CheckpointSettings,
  createGymApp,
  createLogger,
  type GymApp,
  jsonBody,
  type Logger,
  mountRoutes,
  SessionRouter,
  SessionWorker,
  type WorkerLink,
  type WorkerSide,
} from '@ckpt-gym/core/server';

import type { Agent, AgentDefinition } from './agent.js';
import { AgentParticipant, type AgentSessionRecord } from './participant.js';
import { installRestartOnly, RestartOnlyParticipant } from './restart-only.js';
import { closeRoute } from './routes/close.js';
import { AGENT_BODY_LIMIT, type AgentServerContext } from './routes/context.js';
import { legacyRunRoute } from './routes/legacy-run.js';
import { agentSessionOf } from './routing.js';
import { responsesRoute } from './routes/responses.js';
import { seedRoute } from './routes/seed.js';
import {
  AgentSessionTable,
  DEFAULT_CLOSE_RETRY_WINDOW_SECONDS,
  SessionCookieSigner,
} from './sessions.js';

export interface AgentServerOptions {
  /** The server's name in the stack file (its checkpoint instance). */
  name: string;
  checkpoint: CheckpointSettings | undefined;
  /** The agent's own settings (snake_case keys, as in the stack file, server names resolved). */
  config?: Readonly<Record<string, unknown>>;
  logger?: Logger;
  /** Shared clients (not closed by the server); otherwise the server creates its own. */
  clients?: HttpClients;
  /** Pool limits of the clients the server creates. */
  httpLimits?: HttpClientLimits;
  /** Signs the session cookie; defaults to one derived from the server's name. */
  cookieSecret?: string;
  closeRetryWindowSeconds?: number;
  /** On a worker of a server with several workers: its routing id and the runtime directory. */
  routing?: { routingId: string; socketDir: string } | undefined;
  /** On such a worker with checkpointing on: its link to the coordinator. */
  link?: WorkerLink | undefined;
}

export interface AgentServer<S> {
  readonly app: Express;
  readonly gym: GymApp<CheckpointRecord>;
  readonly agent: Agent<S>;
  readonly sessions: AgentSessionTable<S>;
  /** The agent participant, the restart-only one, or undefined when checkpointing is off. */
  readonly participant: AgentParticipant | RestartOnlyParticipant | undefined;
  /** On a worker of a server with several workers: its session router (listen on its socket). */
  readonly router: SessionRouter | undefined;
  /** On such a worker with checkpointing on: its share of the participant, to attach. */
  readonly worker: WorkerSide | undefined;
  /** Stops the control plane's timers and frees the HTTP client pools the server created. */
  close(): void;
}

/**
 * The agent participant for an agent with session hooks, else the restart-only one, whose retire
 * frees a seeded session through the agent's close hook.
 */
function agentParticipantFor<S>(
  name: string,
  agent: Agent<S>,
  sessions: AgentSessionTable<S>,
  owner: string | undefined,
): AgentParticipant | RestartOnlyParticipant {
  if (agent.checkpointSessionsSupported && agent.hooks) {
    return new AgentParticipant(name, agent.hooks, { owner });
  }
  return new RestartOnlyParticipant(name, async (key) => {
    const entry = sessions.get(key);
    if (!entry) return;
    entry.closing = true;
    await agent.closeSession(entry);
    sessions.delete(key);
  });
}

/** A worker's share of the participant; the agent participant claims restored `/run`s through it. */
function workerFor(
  participant: AgentParticipant | RestartOnlyParticipant,
  router: SessionRouter,
  link: WorkerLink,
  logger: Logger,
): WorkerSide {
  if (participant instanceof RestartOnlyParticipant) {
    return new SessionWorker<CheckpointRecord>(participant, router, link, logger);
  }
  const worker = new SessionWorker<AgentSessionRecord>(participant, router, link, logger);
  participant.claims = worker;
  return worker;
}

export function createAgentServer<S>(
  definition: AgentDefinition<S>,
  options: AgentServerOptions,
): AgentServer<S> {
  const clients = options.clients ?? createHttpClients(options.httpLimits);
  const ownsClients = options.clients === undefined;
  const sessions = new AgentSessionTable<S>(
    options.closeRetryWindowSeconds ?? DEFAULT_CLOSE_RETRY_WINDOW_SECONDS,
  );
  const routingId = options.routing?.routingId;
  const signer = new SessionCookieSigner(
    options.cookieSecret ?? `ckpt-gym-agent___${options.name}`,
    routingId,
  );
  const logger = options.logger ?? createLogger({ server: options.name, kind: 'agent' });
  const agent = definition({
    name: options.name,
    config: options.config ?? {},
    sessions,
    clients,
    logger,
    checkpointing: options.checkpoint !== undefined,
  });

  const participant = options.checkpoint
    ? agentParticipantFor(options.name, agent, sessions, routingId)
    : undefined;
  const router = options.routing
    ? new SessionRouter({ ...options.routing, sessionOf: agentSessionOf(signer), logger })
    : undefined;
  const { link } = options;
  const gym = createGymApp<CheckpointRecord>({
    name: options.name,
    kind: 'agent',
    checkpoint: options.checkpoint,
    ...(participant && !link ? { participant } : {}),
    ...(participant && link ? { control: link.controlTarget() } : {}),
    ...(router ? { sessionRouter: router.middleware() } : {}),
    logger,
  });
  const worker =
    participant && link && router ? workerFor(participant, router, link, logger) : undefined;
  const app = gym.app;
  // App-wide, not per route: the restart-only tracking reads a `/run` body's rollout, and the
  // agent's own routes read JSON too (the routes' own body rule then finds it parsed).
  app.use(jsonBody(AGENT_BODY_LIMIT));
  if (participant instanceof RestartOnlyParticipant) installRestartOnly(app, participant);
  const server: AgentServerContext<S> = {
    agent,
    sessions,
    signer,
    routingId,
    agentParticipant: participant instanceof AgentParticipant ? participant : undefined,
    restartOnly: participant instanceof RestartOnlyParticipant ? participant : undefined,
  };
  mountRoutes(app, [
    seedRoute(server),
    responsesRoute(server),
    closeRoute(server),
    legacyRunRoute(server),
  ]);

  agent.setupRoutes?.(app);
  gym.finish();

  return {
    app,
    gym,
    agent,
    sessions,
    participant,
    router,
    worker,
    close() {
      gym.plane?.dispose();
      if (ownsClients) clients.close();
    },
  };
}
