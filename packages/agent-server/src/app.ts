/**
 * The agent server: agent sessions (seed, activation, close) over an agent definition, with the
 * agent participant when the agent has session hooks, a restart-only participant when it has not,
 * and nothing at all when checkpointing is off.
 */
import type { Express, Request, Response } from 'express';

import {
  AGENT_ACTIVATION_HEADER,
  captureKey,
  CHECKPOINT_RESTART_HEADER,
  CheckpointError,
  type CheckpointRecord,
  type CheckpointSettings,
  createGymApp,
  createHttpClients,
  createLogger,
  episodeFromRunBody,
  type EpisodeId,
  episodeIdFromJson,
  type GymApp,
  type HttpClientLimits,
  type HttpClients,
  InvalidRequestError,
  type JsonObject,
  jsonBody,
  type Logger,
  NotFoundError,
  requestEpisode,
  requestSignal,
  RolloutIdRequiredError,
  sameEpisode,
  StaleAttemptError,
} from '@ckpt-gym/core';

import {
  decideActivation,
  invocationId,
  nextActivationCount,
  parseActivationHeader,
} from './activation.js';
import { type Agent, type AgentDefinition, type AgentReply, untrackedHandle } from './agent.js';
import { untrackedEpisode } from './legacy-run.js';
import {
  type ActivationHandle,
  AgentParticipant,
  legacyKey,
  untilSettledOr,
} from './participant.js';
import { installRestartOnly, RestartOnlyParticipant, restartSignal } from './restart-only.js';
import {
  AGENT_SESSION_COOKIE,
  type AgentSessionEntry,
  AgentSessionTable,
  type CloseReceipt,
  DEFAULT_CLOSE_RETRY_WINDOW_SECONDS,
  parseAgentSessionId,
  parseCookieHeader,
  parseSeedRequest,
  seedFingerprint,
  SessionCookieSigner,
  sessionIdFromCookie,
} from './sessions.js';

const ROLLOUT_ID_REQUIRED =
  'checkpointing requires a rollout id on every agent call: send _ng_rollout_id or the /ng-rollout/<id> prefix';

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
}

export interface AgentServer<S> {
  readonly app: Express;
  readonly gym: GymApp<CheckpointRecord>;
  readonly agent: Agent<S>;
  readonly sessions: AgentSessionTable<S>;
  /** The agent participant, the restart-only one, or undefined when checkpointing is off. */
  readonly participant: AgentParticipant | RestartOnlyParticipant | undefined;
  /** Stops the control plane's timers and frees the HTTP client pools the server created. */
  close(): void;
}

/** A session-level conflict (the reference's FastAPI 409s) in the one error shape. */
function conflict(detail: string): CheckpointError {
  return new CheckpointError(detail);
}

function bodyObject(body: unknown): JsonObject {
  if (typeof body !== 'object' || body === null || Array.isArray(body)) {
    throw new InvalidRequestError('body: must be a JSON object');
  }
  return body as JsonObject;
}

type Handler = (req: Request, res: Response, signal: AbortSignal) => Promise<void>;

/** A route whose work stops when the client goes away; that abort is no server error. */
function route(handler: Handler) {
  return async (req: Request, res: Response): Promise<void> => {
    const signal = requestSignal(req, res);
    try {
      await handler(req, res, signal);
    } catch (err) {
      if (signal.aborted) {
        res.destroy();
        return;
      }
      throw err;
    }
  };
}

/** Runs `work`; when `signal` stopped it, reports why (a retire, a close) rather than how it broke. */
async function stoppedBy<T>(signal: AbortSignal, work: () => Promise<T>): Promise<T> {
  try {
    return await work();
  } catch (err) {
    const reason: unknown = signal.reason;
    throw signal.aborted && reason instanceof Error ? reason : err;
  }
}

function sendReply(res: Response, reply: AgentReply): void {
  for (const [name, value] of Object.entries(reply.cookies)) res.cookie(name, value, { path: '/' });
  res.json(reply.response);
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
  const signer = new SessionCookieSigner(
    options.cookieSecret ?? `ckpt-gym-agent___${options.name}`,
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

  let participant: AgentParticipant | RestartOnlyParticipant | undefined;
  if (options.checkpoint) {
    participant =
      agent.checkpointSessionsSupported && agent.hooks
        ? new AgentParticipant(options.name, agent.hooks)
        : new RestartOnlyParticipant(options.name, async (key) => {
            await releaseSession(key);
          });
  }
  const gym = createGymApp<CheckpointRecord>({
    name: options.name,
    kind: 'agent',
    checkpoint: options.checkpoint,
    ...(participant ? { participant } : {}),
    logger,
  });
  const app = gym.app;
  app.use(jsonBody('256mb'));
  if (participant instanceof RestartOnlyParticipant) installRestartOnly(app, participant);
  const agentParticipant = participant instanceof AgentParticipant ? participant : undefined;
  const restartOnly = participant instanceof RestartOnlyParticipant ? participant : undefined;

  /** Frees a session through the agent's close hook (a restart-only retire). */
  async function releaseSession(key: string): Promise<void> {
    const entry = sessions.get(key);
    if (!entry) return;
    entry.closing = true;
    await agent.closeSession(entry);
    sessions.delete(key);
  }

  // --- seed -----------------------------------------------------------------------------------

  async function buildSession(
    request: ReturnType<typeof parseSeedRequest>,
  ): Promise<AgentSessionEntry<S>> {
    const id = request.agent_session_id;
    const fingerprint = seedFingerprint(request);
    const pending = sessions.building.get(id);
    if (pending) {
      if (pending.fingerprint !== fingerprint) {
        throw conflict('agent_session_id is already bound to another seed request');
      }
      return pending.done;
    }
    const done = (async () => {
      const state = await agent.seedSession(request);
      const entry: AgentSessionEntry<S> = {
        id,
        request,
        fingerprint,
        episode: request.episode_id,
        activations: 0,
        completedActivation: 0,
        completedReply: null,
        closing: false,
        state,
      };
      sessions.set(entry);
      return entry;
    })();
    const building = { fingerprint, done };
    sessions.building.set(id, building);
    try {
      return await done;
    } finally {
      if (sessions.building.get(id) === building) sessions.building.delete(id);
    }
  }

  app.post(
    '/v1/agent_sessions',
    route(async (req, res, signal) => {
      const request = parseSeedRequest(req.body);
      const id = request.agent_session_id;
      const cookieId = sessionIdFromCookie(req.headers.cookie, signer);
      if (cookieId !== undefined && cookieId !== id) {
        throw conflict('agent_session_id does not match the session cookie');
      }
      const receipt = sessions.receipt(id);
      if (receipt !== undefined && receipt !== 'expired')
        throw conflict('Agent session is already closed');
      const existing = sessions.get(id);
      if (existing?.closing) throw conflict('Agent session is closing');
      if (existing && existing.fingerprint !== seedFingerprint(request)) {
        throw conflict('agent_session_id is already bound to another seed request');
      }
      if (!existing) {
        const build = () => buildSession(request);
        if (agentParticipant) {
          await agentParticipant.seeding(
            id,
            request.episode_id,
            build,
            async () => {
              sessions.delete(id);
            },
            signal,
          );
        } else if (restartOnly) {
          await restartOnly.seeding(id, request.episode_id, build, signal);
        } else {
          await build();
        }
      }
      if (restartOnly) res.setHeader(CHECKPOINT_RESTART_HEADER, '1');
      res.cookie(AGENT_SESSION_COOKIE, signer.sign(id), {
        path: '/',
        httpOnly: true,
        sameSite: 'lax',
      });
      res.json({ agent_session_id: id });
    }),
  );

  // --- activation -----------------------------------------------------------------------------

  async function runActivation(
    entry: AgentSessionEntry<S>,
    episode: EpisodeId | undefined,
    index: number | null,
    handle: ActivationHandle,
    body: JsonObject,
    cookies: Record<string, string>,
    keepReply: boolean,
  ): Promise<AgentReply> {
    entry.activations = nextActivationCount(entry.activations, index, handle.continuation !== null);
    const reply = await agent.respond({
      body,
      // A legacy run's loop uses the configured resources server and the request's cookies.
      session: entry.id.startsWith('run:') ? null : entry,
      episode,
      invocationId: invocationId(entry.activations),
      handle,
      keepTrajectory: index === null || entry.id.startsWith('run:'),
      cookies,
    });
    // Recorded before the activation ends, so a checkpoint exports the reply with the session.
    entry.completedActivation = entry.activations;
    entry.completedReply = keepReply && index !== null ? reply : null;
    return reply;
  }

  /** An activation under the agent participant: index rules, attempt check, then run or replay. */
  async function checkpointedActivation(
    p: AgentParticipant,
    entry: AgentSessionEntry<S>,
    episode: EpisodeId,
    index: number | null,
    body: JsonObject,
    cookies: Record<string, string>,
    signal: AbortSignal,
  ): Promise<AgentReply> {
    while (true) {
      p.checkAttempt(entry.id, episode);
      const running = p.runningActivation(entry.id);
      const decision = decideActivation(
        {
          sessionId: entry.id,
          completedActivation: entry.completedActivation,
          hasStoredReply: entry.completedReply !== null,
          runningIndex: running?.index ?? null,
          running: running !== null,
        },
        index,
      );
      if (decision.kind === 'wait') {
        await untilSettledOr(running!.done, signal);
        continue;
      }
      if (decision.kind === 'replay') {
        p.claim(entry.id);
        return entry.completedReply!;
      }
      return p.activate(
        entry.id,
        episode,
        index,
        (handle) => runActivation(entry, episode, index, handle, body, cookies, true),
        signal,
      );
    }
  }

  app.post(
    '/v1/responses',
    route(async (req, res, signal) => {
      const episode = requestEpisode(req);
      const body = bodyObject(req.body);
      const cookies = parseCookieHeader(req.headers.cookie);
      const sessionId = sessionIdFromCookie(req.headers.cookie, signer);
      delete cookies[AGENT_SESSION_COOKIE];
      const header = req.header(AGENT_ACTIVATION_HEADER);

      if (agentParticipant && episode && agentParticipant.marks.isRetired(episode)) {
        throw new StaleAttemptError(`attempt ${captureKey(episode)} was retired`);
      }
      if (sessionId !== undefined) {
        if (agentParticipant && !episode) throw new RolloutIdRequiredError(ROLLOUT_ID_REQUIRED);
        const entry = sessions.get(sessionId);
        if (!entry || entry.closing) throw conflict('Unknown or closing agent_session_id');
        if (agentParticipant) {
          const reply = await checkpointedActivation(
            agentParticipant,
            entry,
            episode!,
            parseActivationHeader(header),
            body,
            cookies,
            signal,
          );
          sendReply(res, reply);
          return;
        }
        const runSignal = restartOnly ? AbortSignal.any([signal, restartSignal(req)!]) : signal;
        const reply = await stoppedBy(runSignal, () =>
          runActivation(
            entry,
            episode,
            null,
            untrackedHandle(entry.id, runSignal),
            body,
            cookies,
            false,
          ),
        );
        sendReply(res, reply);
        return;
      }

      if (agentParticipant) {
        if (!episode) throw new RolloutIdRequiredError(ROLLOUT_ID_REQUIRED);
        const legacy = sessions.get(legacyKey(episode.rollout_id));
        if (legacy && agentParticipant.has(legacy.id) && sameEpisode(legacy.episode, episode)) {
          const reply = await checkpointedActivation(
            agentParticipant,
            legacy,
            episode,
            parseActivationHeader(header),
            body,
            cookies,
            signal,
          );
          sendReply(res, reply);
          return;
        }
        // A direct call is a restart: nothing captures a loop that no session owns.
        const reply = await agentParticipant.directRestart(episode, (retired) =>
          directCall(episode, body, cookies, AbortSignal.any([retired, signal])),
        );
        sendReply(res, reply);
        return;
      }
      const runSignal = restartOnly ? AbortSignal.any([signal, restartSignal(req)!]) : signal;
      sendReply(res, await directCall(episode, body, cookies, runSignal));
    }),
  );

  function directCall(
    episode: EpisodeId | undefined,
    body: JsonObject,
    cookies: Record<string, string>,
    signal: AbortSignal,
  ): Promise<AgentReply> {
    return stoppedBy(signal, () =>
      agent.respond({
        body,
        session: null,
        episode,
        invocationId: invocationId(1),
        handle: untrackedHandle('direct', signal),
        keepTrajectory: true,
        cookies,
      }),
    );
  }

  // --- close ----------------------------------------------------------------------------------

  const closes = new Map<string, Promise<CloseReceipt>>();

  async function closeEntry(
    entry: AgentSessionEntry<S>,
    signal: AbortSignal,
  ): Promise<CloseReceipt> {
    const cleanup = async (): Promise<CloseReceipt> => {
      entry.closing = true;
      const result = await agent.closeSession(entry);
      return {
        agent_session_id: entry.id,
        agent_observations: result.agent_observations,
        resources_cookies: result.resources_cookies,
      };
    };
    const receipt = agentParticipant
      ? await agentParticipant.closeSession(entry.id, cleanup, signal)
      : await cleanup();
    sessions.delete(entry.id);
    sessions.writeReceipt(receipt, entry.episode);
    restartOnly?.closed(entry.id);
    return receipt;
  }

  app.post(
    '/v1/agent_sessions/close',
    route(async (req, res, signal) => {
      const body = bodyObject(req.body);
      const id = parseAgentSessionId(body.agent_session_id);
      const episode =
        body.episode_id === undefined ? undefined : episodeIdFromJson(body.episode_id);
      const cookieId = sessionIdFromCookie(req.headers.cookie, signer);
      if (cookieId !== undefined && cookieId !== id) {
        throw conflict('agent_session_id does not match the session cookie');
      }
      const kept = sessions.receipt(id);
      if (kept === 'expired') throw conflict('Agent close receipt has expired');
      if (kept) {
        if (episode && kept.episode && !sameEpisode(kept.episode, episode)) {
          throw conflict('episode_id does not match the seeded agent session');
        }
        res.json(kept.receipt);
        return;
      }
      const entry = sessions.get(id);
      if (!entry) {
        // A receipt for an unknown id blocks a seed racing this close.
        const receipt: CloseReceipt = {
          agent_session_id: id,
          agent_observations: null,
          resources_cookies: null,
        };
        sessions.writeReceipt(receipt, episode ?? null);
        res.json(receipt);
        return;
      }
      if (episode && !sameEpisode(entry.episode, episode)) {
        throw conflict('episode_id does not match the seeded agent session');
      }
      let closing = closes.get(id);
      if (!closing) {
        closing = closeEntry(entry, signal);
        closes.set(id, closing);
        const mine = closing;
        void mine.then(
          () => closes.get(id) === mine && closes.delete(id),
          () => closes.get(id) === mine && closes.delete(id),
        );
      }
      res.json(await closing);
    }),
  );

  // --- legacy /run ---------------------------------------------------------------------------

  /** The `run:<rollout>` session a legacy run's self-dispatch activates (index 1). */
  async function legacyEntry(key: string, episode: EpisodeId): Promise<AgentSessionEntry<S>> {
    const existing = sessions.get(key);
    if (existing && sameEpisode(existing.episode, episode)) return existing;
    const request = {
      agent_session_id: key,
      episode_id: episode,
      task_id: null,
      tool_accesses: [],
      sandbox_access: null,
    };
    const entry: AgentSessionEntry<S> = {
      id: key,
      request,
      fingerprint: seedFingerprint(request),
      episode,
      activations: 0,
      completedActivation: 0,
      completedReply: null,
      closing: false,
      state: await agent.seedSession(request),
    };
    sessions.set(entry);
    return entry;
  }

  app.post(
    '/run',
    route(async (req, res, signal) => {
      const run = agent.legacyRun?.bind(agent);
      if (!run) throw new NotFoundError('this agent has no legacy /run');
      const body = bodyObject(req.body);
      const episode = requestEpisode(req) ?? episodeFromRunBody(body);
      const cookies = parseCookieHeader(req.headers.cookie);
      const selfUrl = `${req.protocol}://${req.headers.host ?? ''}`;
      if (!agentParticipant) {
        const runSignal = restartOnly ? AbortSignal.any([signal, restartSignal(req)!]) : signal;
        const ep = untrackedEpisode('run', runSignal);
        res.json(
          await stoppedBy(runSignal, () =>
            run({ body, episode, selfUrl, cookies, ep, loopReplied: () => undefined }),
          ),
        );
        return;
      }
      if (!episode) throw new RolloutIdRequiredError(ROLLOUT_ID_REQUIRED);
      const key = legacyKey(episode.rollout_id);
      const result = await agentParticipant.legacyRun(episode, async (ep) => {
        const entry = await legacyEntry(key, episode);
        try {
          return await stoppedBy(ep.signal, () =>
            run({
              body,
              episode,
              selfUrl,
              cookies,
              ep,
              loopReplied: () => {
                entry.completedReply = null;
              },
            }),
          );
        } finally {
          // The kept reply leaves when the run ends (a retire frees it otherwise).
          if (sessions.get(key) === entry) sessions.delete(key);
        }
      });
      res.json(result);
    }),
  );

  agent.setupRoutes?.(app);
  gym.finish();

  return {
    app,
    gym,
    agent,
    sessions,
    participant,
    close() {
      gym.plane?.dispose();
      if (ownsClients) clients.close();
    },
  };
}
