/**
 * The `environment` server kind: what `ckpt-gym serve` and this package's bin start. With
 * `num_workers: N > 1` and checkpointing on, the primary process runs the environment coordinator
 * (core's `ParticipantCoordinator`: the participant; it holds restored episodes until a worker's
 * replacement `/run` claims one) and each forked worker its own participant, attached before it
 * listens.
 */
import {
  listenGymServer,
  ParticipantCoordinator,
  serverOfKind,
  type ServerKindModule,
} from '@ckpt-gym/core/server';

import { ENVIRONMENT_APPS, ENVIRONMENT_CONFIG_SCHEMA } from './config.js';
import { EnvironmentParticipant, type EnvironmentRecord } from './participant.js';
import { environmentServerFromStack } from './registry.js';

export const environmentKind: ServerKindModule<'environment'> = {
  kind: 'environment',
  configSchema: {
    apps: Object.fromEntries(ENVIRONMENT_APPS.map((app) => [app, ENVIRONMENT_CONFIG_SCHEMA])),
  },
  async fromStack(stack, name, options = {}) {
    const { server, settings, clients } = environmentServerFromStack(stack, name, {
      ...options,
      link: options.worker?.link,
    });
    if (server.worker) await options.worker!.link!.attach(server.worker);
    return listenGymServer(settings, server.app, options, {
      plane: server.plane,
      async close(listening) {
        server.plane?.dispose();
        await listening.close();
        clients.close();
      },
    });
  },
  workers: {
    coordinator(stack, name, { expectedWorkers, logger }) {
      serverOfKind(stack, name, 'environment');
      // Records are checked as the one-process participant checks them; each episode's state
      // lives inside its `/run`, so every record waits here for its replacement's claim.
      const records = new EnvironmentParticipant(name);
      return new ParticipantCoordinator<EnvironmentRecord>({
        kind: 'environment',
        instance: name,
        expectedWorkers,
        logger,
        records: {
          validateRecord: (record, key) => records.validateRecord(record, key),
          validateRawRecord: (record, key) => records.validateRawRecord(record, key),
          claimedByRequest: () => true,
        },
      });
    },
  },
};
