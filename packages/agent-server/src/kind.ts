/**
 * The `agent` server kind: what `ckpt-gym serve` and this package's bin start. With
 * `num_workers: N > 1` every forked worker routes each session's requests to the worker that owns
 * it (core's `SessionRouter`, on its own socket in the server's runtime directory), and with
 * checkpointing on the primary runs core's `SessionCoordinator` (the participant) and each worker
 * its `SessionWorker`, attached before it listens.
 */
import {
  type FromStackOptions,
  listenGymServer,
  type Logger,
  newRoutingId,
  serverOfKind,
  type ServerKindModule,
  SessionCoordinator,
} from '@ckpt-gym/core/server';

import type { AgentServer } from './app.js';
import { SIMPLE_AGENT_CONFIG_SCHEMA } from './config.js';
import {
  agentRecordOf,
  type AgentSessionRecord,
  isLegacyRecord,
  placedRecordOfRaw,
} from './participant.js';
import { createAgentServerFromStack } from './registry.js';

/**
 * The participant of an agent server with several workers. A native session spans requests: its
 * record is read no further than the fields that place it (`placedRecordOfRaw`), it is placed on
 * a worker with its owner aliased there, and that worker checks it whole, as the one-process
 * participant does. A legacy `/run`'s state lives inside its request: its record is checked here
 * and waits for the replacement `/run`'s claim. A restart-only agent exports nothing.
 */
export function agentCoordinator(options: {
  instance: string;
  expectedWorkers: number;
  logger?: Logger | undefined;
}): SessionCoordinator<AgentSessionRecord> {
  return new SessionCoordinator<AgentSessionRecord>({
    kind: 'agent',
    ...options,
    records: {
      validateRecord: agentRecordOf,
      validateRawRecord: placedRecordOfRaw,
      claimedByRequest: isLegacyRecord,
      sessionOf: (record) => ({ id: record.session_key, owner: record.owner }),
      exportedFields: ['session_key', 'owner'],
    },
  });
}

/** Serves a worker's own socket and links its participant to the coordinator. */
async function attachWorker(agent: AgentServer<unknown>, options: FromStackOptions): Promise<void> {
  if (!agent.router) return;
  await agent.router.listen(agent.app);
  if (agent.worker) await options.worker!.link!.attach(agent.worker);
}

export const agentKind: ServerKindModule<'agent'> = {
  kind: 'agent',
  configSchema: { apps: { simple: SIMPLE_AGENT_CONFIG_SCHEMA } },
  async fromStack(stack, name, options = {}) {
    const settings = serverOfKind(stack, name, 'agent');
    const worker = options.worker;
    const agent = createAgentServerFromStack(stack, name, {
      ...options,
      ...(worker
        ? {
            routing: { routingId: newRoutingId(), socketDir: worker.runtimeDir },
            link: worker.link,
          }
        : {}),
    });
    await attachWorker(agent, options);
    return listenGymServer(settings, agent.app, options, {
      plane: agent.gym.plane,
      async close(listening) {
        await listening.close();
        await agent.router?.close();
        agent.close();
      },
    });
  },
  workers: {
    coordinator(stack, name, { expectedWorkers, logger }) {
      serverOfKind(stack, name, 'agent');
      return agentCoordinator({ instance: name, expectedWorkers, logger });
    },
  },
};
