/**
 * How an agent request names its session, for the session router of a server with several
 * workers (core's `SessionRouter`): by its signed `agent_session_id` cookie, whose text names the
 * owning worker. A legacy `/run`'s self-dispatch to `/v1/responses` carries no session cookie:
 * it names the worker running the `/run` (whose `run:<rollout>` session it activates) in
 * `AGENT_WORKER_HEADER`. A value that does not verify names no session, so the request is served
 * where it landed and refused or given a new session there as in one process.
 */
import type { IncomingMessage } from 'node:http';

import { isRoutingId, type SessionOf, type SessionRef } from '@ckpt-gym/core/server';

import { AGENT_SESSION_COOKIE, parseCookieHeader, type SessionCookieSigner } from './sessions.js';

/** The routing id of the worker whose legacy `/run` sent this self-dispatch. */
export const AGENT_WORKER_HEADER = 'x-ckpt-gym-agent-worker';

function selfDispatchOf(req: IncomingMessage): SessionRef | undefined {
  const owner = req.headers[AGENT_WORKER_HEADER];
  // Only the owner routes it: the run's session is found there by the rollout prefix.
  return isRoutingId(owner) ? { id: AGENT_WORKER_HEADER, owner } : undefined;
}

export function agentSessionOf(signer: SessionCookieSigner): SessionOf {
  return (req) => {
    const value = parseCookieHeader(req.headers.cookie)[AGENT_SESSION_COOKIE];
    return (value === undefined ? undefined : signer.verifyRef(value)) ?? selfDispatchOf(req);
  };
}
