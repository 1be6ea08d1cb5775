/**
 * `POST /v1/responses`: an activation of a seeded session (its cookie names it), or a direct call
 * no session owns. Under the agent participant an activation keeps the index rules and replays a
 * finished one; a direct call is a restart.
 */
import {
  AGENT_ACTIVATION_HEADER,
  captureKey,
  type EpisodeId,
  type JsonObject,
  parseActivationHeader,
  sameEpisode,
  StaleAttemptError,
} from '@ckpt-gym/core/protocol';
import { gymRoute, type GymRoute } from '@ckpt-gym/core/server';
import type { Request } from 'express';

import { decideActivation, invocationId, nextActivationCount } from '../activation.js';
import { type AgentReply, untrackedHandle } from '../agent.js';
import {
  type ActivationHandle,
  type AgentParticipant,
  legacyKey,
  untilSettledOr,
} from '../participant.js';
import {
  AGENT_SESSION_COOKIE,
  type AgentSessionEntry,
  parseCookieHeader,
  sessionIdFromCookie,
} from '../sessions.js';
import {
  type AgentServerContext,
  conflict,
  objectBodyRule,
  runSignal,
  sendReply,
  stoppedBy,
} from './context.js';

/** One `/v1/responses` request, as its handlers read it. */
interface Call {
  readonly req: Request;
  readonly body: JsonObject;
  readonly episode: EpisodeId | undefined;
  /** The request's cookies, the agent session's own left out. */
  readonly cookies: Record<string, string>;
  readonly sessionId: string | undefined;
  readonly signal: AbortSignal;
}

/** Runs one activation of `entry` and records its reply on the entry. */
export async function runActivation<S>(
  { agent }: AgentServerContext<S>,
  entry: AgentSessionEntry<S>,
  call: Pick<Call, 'body' | 'episode' | 'cookies'>,
  index: number | null,
  handle: ActivationHandle,
  keepReply: boolean,
): Promise<AgentReply> {
  entry.activations = nextActivationCount(entry.activations, index, handle.continuation !== null);
  const reply = await agent.respond({
    body: call.body,
    // A legacy run's loop uses the configured resources server and the request's cookies.
    session: entry.id.startsWith('run:') ? null : entry,
    episode: call.episode,
    invocationId: invocationId(entry.activations),
    handle,
    keepTrajectory: index === null || entry.id.startsWith('run:'),
    cookies: call.cookies,
  });
  // Recorded before the activation ends, so a checkpoint exports the reply with the session.
  entry.completedActivation = entry.activations;
  entry.completedReply = keepReply && index !== null ? reply : null;
  return reply;
}

/** An activation under the agent participant: index rules, attempt check, then run or replay. */
async function checkpointedActivation<S>(
  server: AgentServerContext<S>,
  p: AgentParticipant,
  entry: AgentSessionEntry<S>,
  call: Call & { readonly episode: EpisodeId },
): Promise<AgentReply> {
  const index = parseActivationHeader(call.req.header(AGENT_ACTIVATION_HEADER));
  while (true) {
    p.checkAttempt(entry.id, call.episode);
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
      await untilSettledOr(running!.done, call.signal);
      continue;
    }
    if (decision.kind === 'replay') {
      p.claim(entry.id);
      return entry.completedReply!;
    }
    return p.activate(
      entry.id,
      call.episode,
      index,
      (handle) => runActivation(server, entry, call, index, handle, true),
      call.signal,
    );
  }
}

/** A call no session owns: the agent's loop, untracked. */
function directCall<S>(
  { agent }: AgentServerContext<S>,
  call: Pick<Call, 'body' | 'episode' | 'cookies'>,
  signal: AbortSignal,
): Promise<AgentReply> {
  return stoppedBy(signal, () =>
    agent.respond({
      body: call.body,
      session: null,
      episode: call.episode,
      invocationId: invocationId(1),
      handle: untrackedHandle('direct', signal),
      keepTrajectory: true,
      cookies: call.cookies,
    }),
  );
}

/** The session the cookie names, open. */
function openSession<S>(server: AgentServerContext<S>, id: string): AgentSessionEntry<S> {
  const entry = server.sessions.get(id);
  if (!entry || entry.closing) throw conflict('Unknown or closing agent_session_id');
  return entry;
}

/**
 * Under the agent participant (the route requires the prefix): the cookie's session, else the
 * legacy run's `run:<rollout>` session of this attempt, is activated; else the call is a direct
 * restart, since nothing captures a loop that no session owns.
 */
function checkpointedResponse<S>(
  server: AgentServerContext<S>,
  p: AgentParticipant,
  call: Call & { readonly episode: EpisodeId },
): Promise<AgentReply> {
  const { episode, signal } = call;
  if (p.marks.isRetired(episode)) {
    throw new StaleAttemptError(`attempt ${captureKey(episode)} was retired`);
  }
  let entry: AgentSessionEntry<S> | undefined;
  if (call.sessionId !== undefined) {
    entry = openSession(server, call.sessionId);
  } else {
    const legacy = server.sessions.get(legacyKey(episode.rollout_id));
    if (legacy && p.has(legacy.id) && sameEpisode(legacy.episode, episode)) entry = legacy;
  }
  if (entry) return checkpointedActivation(server, p, entry, call);
  return p.directRestart(episode, (retired) =>
    directCall(server, call, AbortSignal.any([retired, signal])),
  );
}

/** Without the agent participant: the cookie's session's activation, else a direct call. */
function untrackedResponse<S>(server: AgentServerContext<S>, call: Call): Promise<AgentReply> {
  const signal = runSignal(server, call.req, call.signal);
  if (call.sessionId === undefined) return directCall(server, call, signal);
  const entry = openSession(server, call.sessionId);
  return stoppedBy(signal, () =>
    runActivation(server, entry, call, null, untrackedHandle(entry.id, signal), false),
  );
}

export function responsesRoute<S>(server: AgentServerContext<S>): GymRoute {
  const p = server.agentParticipant;
  return gymRoute({
    method: 'post',
    path: '/v1/responses',
    // Checkpointing an activation needs its attempt: the agent participant requires the prefix.
    episode: p ? 'required' : 'optional',
    body: objectBodyRule,
    run: ({ req, body, episode, signal }) => {
      const cookies = parseCookieHeader(req.headers.cookie);
      delete cookies[AGENT_SESSION_COOKIE];
      const sessionId = sessionIdFromCookie(req.headers.cookie, server.signer);
      const call: Call = { req, body, episode, cookies, sessionId, signal };
      return p
        ? checkpointedResponse(server, p, { ...call, episode: episode! })
        : untrackedResponse(server, call);
    },
    reply: sendReply,
  });
}
