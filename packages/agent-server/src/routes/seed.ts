/** `POST /v1/agent_sessions`: seeds an agent session, once per id and seed request. */
import {
  type AgentSeedRequest as SeedRequest,
  CHECKPOINT_RESTART_HEADER,
  parseAgentSeedRequest,
} from '@ckpt-gym/core/protocol';
import { gymRoute, type GymRoute } from '@ckpt-gym/core/server';

import {
  AGENT_SESSION_COOKIE,
  type AgentSessionEntry,
  seedFingerprint,
  sessionIdFromCookie,
} from '../sessions.js';
import { AGENT_BODY_LIMIT, type AgentServerContext, conflict } from './context.js';

/** Builds the session, or joins a build of the same seed already under way. */
async function buildSession<S>(
  { agent, sessions }: AgentServerContext<S>,
  request: SeedRequest,
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

/** A seed of a new session: through the participant, which may hold it while a checkpoint is open. */
async function seedNew<S>(
  server: AgentServerContext<S>,
  request: SeedRequest,
  signal: AbortSignal,
): Promise<void> {
  const id = request.agent_session_id;
  const build = () => buildSession(server, request);
  if (server.agentParticipant) {
    await server.agentParticipant.seeding(
      id,
      request.episode_id,
      build,
      async () => {
        server.sessions.delete(id);
      },
      signal,
    );
  } else if (server.restartOnly) {
    await server.restartOnly.seeding(id, request.episode_id, build, signal);
  } else {
    await build();
  }
}

export function seedRoute<S>(server: AgentServerContext<S>): GymRoute {
  const { sessions, signer } = server;
  return gymRoute({
    method: 'post',
    path: '/v1/agent_sessions',
    episode: 'none',
    body: { limit: AGENT_BODY_LIMIT, parse: parseAgentSeedRequest },
    run: async ({ req, res, body: request, signal }) => {
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
      if (!existing) await seedNew(server, request, signal);
      if (server.restartOnly) res.setHeader(CHECKPOINT_RESTART_HEADER, '1');
      res.cookie(AGENT_SESSION_COOKIE, signer.sign(id), {
        path: '/',
        httpOnly: true,
        sameSite: 'lax',
      });
      return { agent_session_id: id };
    },
  });
}
