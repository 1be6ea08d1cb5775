/**
 * A resources server for participant tests: per-session values, handlers that count their calls
 * and can be held by a gate, hooks that record what they were asked and can hang or fail.
 */
import type { JsonValue } from '@ckpt-gym/core/protocol';
import { Gate } from '@ckpt-gym/testing';

import type { ResourcesServerDefinition } from '../src/index.js';

export interface Probe extends ResourcesServerDefinition {
  readonly values: Map<string, number>;
  readonly calls: {
    seed: number;
    reset: number;
    tool: number;
    verify: number;
    close: number;
    exported: string[][];
    restored: string[][];
    retired: string[];
  };
  /** Set to hold the next handlers of that kind until opened. */
  gates: { seed?: Gate; tool?: Gate; verify?: Gate; retire?: Gate };
  /** Sessions the export leaves out (the server dropped them). */
  readonly dropped: Set<string>;
  /** A seed replaces the session id with this one. */
  replaceIdWith?: string;
}

export function probeServer(
  mode: 'exported' | 'stateless' | 'restart_only' = 'exported',
  verify: 'wait' | 'replay' = 'wait',
): Probe {
  const values = new Map<string, number>();
  const probe: Probe = {
    app: 'probe',
    checkpointMode: mode,
    checkpointVerify: verify,
    sessionStarts: ['/seed_session', '/reset'],
    values,
    calls: {
      seed: 0,
      reset: 0,
      tool: 0,
      verify: 0,
      close: 0,
      exported: [],
      restored: [],
      retired: [],
    },
    gates: {},
    dropped: new Set(),
    async seedSession({ sessionId }) {
      probe.calls.seed += 1;
      await probe.gates.seed?.promise;
      const id = probe.replaceIdWith ?? sessionId;
      if (!values.has(id)) values.set(id, 0);
      return { sessionId: id };
    },
    tools: {
      async reset({ sessionId }) {
        probe.calls.reset += 1;
        await probe.gates.seed?.promise;
        values.set(sessionId, 0);
        return { ok: true };
      },
      async bump({ sessionId }) {
        probe.calls.tool += 1;
        await probe.gates.tool?.promise;
        const next = (values.get(sessionId) ?? 0) + 1;
        values.set(sessionId, next);
        return { value: next };
      },
      async finish({ sessionId, endSession }) {
        values.delete(sessionId);
        endSession();
        return { finished: true };
      },
    },
    async verify({ sessionId }) {
      probe.calls.verify += 1;
      await probe.gates.verify?.promise;
      return { reward: values.has(sessionId) ? 1 : 0 };
    },
    closeSession(sessionId) {
      probe.calls.close += 1;
      values.delete(sessionId);
    },
    hooks: {
      async exportSessionStates(ids) {
        probe.calls.exported.push([...ids]);
        const states: Record<string, JsonValue> = {};
        for (const id of ids) {
          if (!probe.dropped.has(id)) states[id] = { value: values.get(id) ?? 0 };
        }
        return states;
      },
      async restoreSessionStates(states) {
        probe.calls.restored.push(Object.keys(states));
        for (const [id, state] of Object.entries(states)) {
          values.set(id, (state as { value: number }).value);
        }
      },
      async retireSessionState(id) {
        probe.calls.retired.push(id);
        await probe.gates.retire?.promise;
        values.delete(id);
      },
    },
  };
  return probe;
}
