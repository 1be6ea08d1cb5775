/**
 * What the agent server's routes share: the agent, its session table and cookie signer, and its
 * participant (the agent participant, the restart-only one, or none with checkpointing off).
 */
import { CheckpointError, type JsonObject } from '@ckpt-gym/core/protocol';
import type { Request, Response } from 'express';

import type { Agent, AgentReply } from '../agent.js';
import type { AgentParticipant } from '../participant.js';
import { type RestartOnlyParticipant, restartSignal } from '../restart-only.js';
import type { AgentSessionTable, SessionCookieSigner } from '../sessions.js';

/** Every agent route reads JSON bodies of at most this much. */
export const AGENT_BODY_LIMIT = '256mb';

export interface AgentServerContext<S> {
  readonly agent: Agent<S>;
  readonly sessions: AgentSessionTable<S>;
  readonly signer: SessionCookieSigner;
  /** On a worker of a server with several workers: its routing id. */
  readonly routingId: string | undefined;
  /** Present when the agent has session hooks and checkpointing is on. */
  readonly agentParticipant: AgentParticipant | undefined;
  /** Present when the agent has no session hooks and checkpointing is on. */
  readonly restartOnly: RestartOnlyParticipant | undefined;
}

/** The body rule of every agent route: a JSON object (its own parser checks the rest). */
export const objectBodyRule = {
  limit: AGENT_BODY_LIMIT,
  parse: (body: JsonObject): JsonObject => body,
};

/** A session-level conflict (the reference's FastAPI 409s) in the one error shape. */
export function conflict(detail: string): CheckpointError {
  return new CheckpointError(detail);
}

/** Runs `work`; when `signal` stopped it, reports why (a retire, a close) rather than how it broke. */
export async function stoppedBy<T>(signal: AbortSignal, work: () => Promise<T>): Promise<T> {
  try {
    return await work();
  } catch (err) {
    const reason: unknown = signal.reason;
    throw signal.aborted && reason instanceof Error ? reason : err;
  }
}

/** The signal an untracked run stops on: the client's, and a restart-only retire's. */
export function runSignal<S>(
  server: AgentServerContext<S>,
  req: Request,
  signal: AbortSignal,
): AbortSignal {
  return server.restartOnly ? AbortSignal.any([signal, restartSignal(req)!]) : signal;
}

export function sendReply(res: Response, reply: AgentReply): void {
  for (const [name, value] of Object.entries(reply.cookies)) res.cookie(name, value, { path: '/' });
  res.json(reply.response);
}
