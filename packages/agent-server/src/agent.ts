/**
 * What an agent implements to run inside the agent server framework. The framework owns the
 * session table, seeds, closes, activation indices and checkpointing; the agent owns its turn loop
 * and its per-session state.
 */
import type { Express } from 'express';

import type { HttpClients } from '@ckpt-gym/core/client';
import type { AgentSeedRequest, EpisodeId, JsonObject, JsonValue } from '@ckpt-gym/core/protocol';
import type { EpisodeContext, Logger } from '@ckpt-gym/core/server';

import type { ActivationHandle, AgentSessionHooks } from './participant.js';
import type { AgentSessionEntry, AgentSessionTable } from './sessions.js';

export interface AgentContext<S> {
  /** The server's name in the stack file. */
  readonly name: string;
  /** The app's own keys from the stack file. */
  readonly config: Readonly<Record<string, unknown>>;
  readonly sessions: AgentSessionTable<S>;
  readonly clients: HttpClients;
  readonly logger: Logger;
  readonly checkpointing: boolean;
}

/** One run of the agent's loop for a `/v1/responses` request. */
export interface Invocation<S> {
  readonly body: JsonObject;
  /** The agent session the request's cookie names (null for a direct or legacy call). */
  readonly session: AgentSessionEntry<S> | null;
  /** The attempt the request's `/ng-rollout/<key>` prefix names. */
  readonly episode: EpisodeId | undefined;
  readonly invocationId: string;
  /** Boundaries and the model-call wrapper (no-ops when nothing is checkpointed). */
  readonly handle: ActivationHandle;
  /** Put the loop's trajectory on the reply (`_ng_trajectory`). */
  readonly keepTrajectory: boolean;
  /** The request's cookies other than the agent session's. */
  readonly cookies: Readonly<Record<string, string>>;
}

export interface AgentReply {
  response: JsonObject;
  /** Cookies to set on the reply. */
  cookies: Record<string, string>;
}

export interface AgentCloseResult {
  agent_observations: JsonValue;
  resources_cookies: Record<string, string> | null;
}

export interface Agent<S> {
  /** True when the agent implements `hooks`; otherwise it is restart-only under checkpointing. */
  readonly checkpointSessionsSupported: boolean;
  readonly hooks?: AgentSessionHooks;
  /** Builds a session's state from its seed; throws a typed error to refuse it. */
  seedSession(request: AgentSeedRequest): Promise<S>;
  respond(invocation: Invocation<S>): Promise<AgentReply>;
  /** The close hook: the session's evidence, then its state is freed. Runs once per session. */
  closeSession(entry: AgentSessionEntry<S>): Promise<AgentCloseResult>;
  /** The legacy whole-episode `/run` (optional). */
  legacyRun?(parts: LegacyRunRequest): Promise<JsonObject>;
  /** Routes of its own (an agent that builds its own app); the framework adds its participant once. */
  setupRoutes?(app: Express): void;
}

export interface LegacyRunRequest {
  readonly body: JsonObject;
  readonly episode: EpisodeId | undefined;
  readonly selfUrl: string;
  /** Headers of the self-dispatch: on a worker, the one routing it back to this worker. */
  readonly selfHeaders: Readonly<Record<string, string>>;
  readonly cookies: Record<string, string>;
  readonly ep: EpisodeContext;
  /** Call in the step that records the `verify` or `return` boundary (which holds the reply). */
  readonly loopReplied: () => void;
}

export type AgentDefinition<S = unknown> = (context: AgentContext<S>) => Agent<S>;

/** A handle for work nothing checkpoints: boundaries record nothing and never park. */
export function untrackedHandle(key: string, signal: AbortSignal): ActivationHandle {
  return {
    key,
    signal,
    continuation: null,
    boundary: async () => undefined,
    awaitingModel: (call) => call(),
  };
}
