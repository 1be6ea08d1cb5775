/**
 * `POST /run`: the agent's legacy whole-episode run. Under the agent participant it runs as the
 * `run:<rollout>` session (its self-dispatched activation is then checkpointed); otherwise it is
 * an untracked run.
 */
import {
  type EpisodeId,
  episodeFromRunBody,
  NotFoundError,
  parseLegacyRunRow,
  RolloutIdRequiredError,
  sameEpisode,
} from '@ckpt-gym/core/protocol';
import { gymRoute, type GymRoute } from '@ckpt-gym/core/server';

import type { Agent, LegacyRunRequest } from '../agent.js';
import { untrackedEpisode } from '../legacy-run.js';
import { legacyKey } from '../participant.js';
import { AGENT_WORKER_HEADER } from '../routing.js';
import { type AgentSessionEntry, parseCookieHeader, seedFingerprint } from '../sessions.js';
import { AGENT_BODY_LIMIT, type AgentServerContext, runSignal, stoppedBy } from './context.js';

const NO_HEADERS: Readonly<Record<string, string>> = {};

type LegacyRun = NonNullable<Agent<unknown>['legacyRun']>;

/** The `run:<rollout>` session a legacy run's self-dispatch activates (index 1). */
async function legacyEntry<S>(
  { agent, sessions }: AgentServerContext<S>,
  key: string,
  episode: EpisodeId,
): Promise<AgentSessionEntry<S>> {
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

/** A run under the agent participant, in its `run:<rollout>` session, freed when the run ends. */
function checkpointedRun<S>(
  server: AgentServerContext<S>,
  run: LegacyRun,
  request: Omit<LegacyRunRequest, 'ep' | 'loopReplied'>,
) {
  const { episode } = request;
  if (!episode) {
    throw new RolloutIdRequiredError(
      'checkpointing requires a rollout id on every agent call: send _ng_rollout_id or the /ng-rollout/<id> prefix',
    );
  }
  const key = legacyKey(episode.rollout_id);
  return server.agentParticipant!.legacyRun(episode, async (ep) => {
    const entry = await legacyEntry(server, key, episode);
    const loopReplied = () => {
      entry.completedReply = null;
    };
    try {
      return await stoppedBy(ep.signal, () => run({ ...request, episode, ep, loopReplied }));
    } finally {
      // The kept reply leaves when the run ends (a retire frees it otherwise).
      if (server.sessions.get(key) === entry) server.sessions.delete(key);
    }
  });
}

export function legacyRunRoute<S>(server: AgentServerContext<S>): GymRoute {
  const run = server.agent.legacyRun?.bind(server.agent);
  if (!run) {
    return gymRoute({
      method: 'post',
      path: '/run',
      episode: 'none',
      run: () => {
        throw new NotFoundError('this agent has no legacy /run');
      },
    });
  }
  return gymRoute({
    method: 'post',
    path: '/run',
    // The prefix names the episode, else the flat row does.
    episode: 'optional',
    body: { limit: AGENT_BODY_LIMIT, parse: parseLegacyRunRow },
    run: async ({ req, body, episode: prefixed, signal }) => {
      const request = {
        body,
        episode: prefixed ?? episodeFromRunBody(body),
        selfUrl: `${req.protocol}://${req.headers.host ?? ''}`,
        // The self-dispatch may land on another worker: it names this one, which runs the session.
        selfHeaders: server.routingId ? { [AGENT_WORKER_HEADER]: server.routingId } : NO_HEADERS,
        cookies: parseCookieHeader(req.headers.cookie),
      };
      if (server.agentParticipant) return checkpointedRun(server, run, request);
      const untracked = runSignal(server, req, signal);
      const ep = untrackedEpisode('run', untracked);
      return stoppedBy(untracked, () => run({ ...request, ep, loopReplied: () => undefined }));
    },
  });
}
