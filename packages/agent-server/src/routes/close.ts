/**
 * `POST /v1/agent_sessions/close`: closes a session once (concurrent closes share one), keeps its
 * receipt for retries, and answers an unknown id with an empty receipt that blocks a racing seed.
 */
import {
  type CloseReceipt,
  type EpisodeId,
  parseAgentCloseRequest,
  sameEpisode,
} from '@ckpt-gym/core/protocol';
import { gymRoute, type GymRoute } from '@ckpt-gym/core/server';

import { type AgentSessionEntry, sessionIdFromCookie } from '../sessions.js';
import { AGENT_BODY_LIMIT, type AgentServerContext, conflict } from './context.js';

async function closeEntry<S>(
  { agent, sessions, agentParticipant, restartOnly }: AgentServerContext<S>,
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

/** A kept receipt answers a repeated close, if it is of the same episode and not expired. */
function keptReceipt(
  kept: { receipt: CloseReceipt; episode: EpisodeId | null } | 'expired',
  episode: EpisodeId | undefined,
): CloseReceipt {
  if (kept === 'expired') throw conflict('Agent close receipt has expired');
  if (episode && kept.episode && !sameEpisode(kept.episode, episode)) {
    throw conflict('episode_id does not match the seeded agent session');
  }
  return kept.receipt;
}

/** The close of an id no session has: an empty receipt, kept, which blocks a seed racing it. */
function emptyReceipt<S>(
  { sessions }: AgentServerContext<S>,
  id: string,
  episode: EpisodeId | undefined,
): CloseReceipt {
  const receipt: CloseReceipt = {
    agent_session_id: id,
    agent_observations: null,
    resources_cookies: null,
  };
  sessions.writeReceipt(receipt, episode ?? null);
  return receipt;
}

export function closeRoute<S>(server: AgentServerContext<S>): GymRoute {
  const closes = new Map<string, Promise<CloseReceipt>>();
  return gymRoute({
    method: 'post',
    path: '/v1/agent_sessions/close',
    episode: 'none',
    body: { limit: AGENT_BODY_LIMIT, parse: parseAgentCloseRequest },
    run: async ({ req, body, signal }) => {
      const { agent_session_id: id, episode_id: episode } = body;
      const cookieId = sessionIdFromCookie(req.headers.cookie, server.signer);
      if (cookieId !== undefined && cookieId !== id) {
        throw conflict('agent_session_id does not match the session cookie');
      }
      const kept = server.sessions.receipt(id);
      if (kept) return keptReceipt(kept, episode);
      const entry = server.sessions.get(id);
      if (!entry) return emptyReceipt(server, id, episode);
      if (episode && !sameEpisode(entry.episode, episode)) {
        throw conflict('episode_id does not match the seeded agent session');
      }
      let closing = closes.get(id);
      if (!closing) {
        closing = closeEntry(server, entry, signal);
        closes.set(id, closing);
        const mine = closing;
        const forget = () => closes.get(id) === mine && closes.delete(id);
        void mine.then(forget, forget);
      }
      return closing;
    },
  });
}
