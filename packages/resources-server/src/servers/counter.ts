/**
 * The counter example (`exported`): a counter per session, exported, restored and retired through
 * the session hooks. Tools: `increment_counter {count}`, `get_counter_value`. Reward 1.0 when the
 * session's counter equals `expected_count` (from the verify body, else the seeded task data).
 */
import { InvalidRequestError, type JsonObject, type JsonValue } from '@ckpt-gym/core/protocol';

import type { ResourcesServerDefinition } from '../definition.js';

function integer(value: JsonValue | undefined, what: string, fallback?: number): number {
  if (value === undefined && fallback !== undefined) return fallback;
  if (typeof value !== 'number' || !Number.isSafeInteger(value)) {
    throw new InvalidRequestError(`${what}: must be an integer`);
  }
  return value;
}

function counterState(state: JsonValue | undefined, sessionId: string): number {
  const count = (state as JsonObject | null)?.count;
  if (
    typeof state !== 'object' ||
    state === null ||
    Array.isArray(state) ||
    typeof count !== 'number' ||
    !Number.isSafeInteger(count)
  ) {
    throw new Error(`invalid counter state for session ${sessionId}`);
  }
  return count;
}

export interface CounterServer extends ResourcesServerDefinition {
  /** The live counters, by session id (for tests and inspection). */
  readonly counters: ReadonlyMap<string, number>;
}

export function counterServer(): CounterServer {
  const counters = new Map<string, number>();
  return {
    app: 'counter',
    checkpointMode: 'exported',
    counters,
    seedSession({ sessionId, body, native }) {
      const source = native ? native.taskData : body;
      const initial = integer(source.initial_count, 'initial_count', 0);
      if (!counters.has(sessionId)) counters.set(sessionId, initial);
    },
    tools: {
      increment_counter({ sessionId, body }) {
        const next = (counters.get(sessionId) ?? 0) + integer(body.count, 'count', 1);
        counters.set(sessionId, next);
        return { success: true };
      },
      get_counter_value({ sessionId }) {
        return { count: counters.get(sessionId) ?? 0 };
      },
    },
    verify({ sessionId, taskData, seededTaskData }) {
      const expected = taskData.expected_count ?? seededTaskData?.expected_count;
      const count = counters.get(sessionId);
      const reward = count !== undefined && count === expected ? 1.0 : 0.0;
      return { reward, extra: { count: count ?? null } };
    },
    closeSession(sessionId) {
      counters.delete(sessionId);
    },
    hooks: {
      async exportSessionStates(sessionIds) {
        const states: Record<string, JsonValue> = {};
        for (const id of sessionIds) {
          const count = counters.get(id);
          // A session it no longer holds is left out, not exported as a new counter at zero.
          if (count !== undefined) states[id] = { count };
        }
        return states;
      },
      async restoreSessionStates(states) {
        const parsed = Object.entries(states).map(
          ([id, state]) => [id, counterState(state, id)] as const,
        );
        for (const [id, count] of parsed) counters.set(id, count);
      },
      async retireSessionState(sessionId) {
        counters.delete(sessionId);
      },
    },
  };
}
