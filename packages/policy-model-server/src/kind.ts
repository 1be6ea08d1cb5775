/**
 * The `model` server kind: what `ckpt-gym serve` and this package's bin start. With
 * `num_workers: N > 1` the primary process runs the policy coordinator (the participant) and each
 * forked worker its share (`worker.ts`), attached to the coordinator before it listens.
 */
import { listenGymServer, serverOfKind, type ServerKindModule } from '@ckpt-gym/core/server';

import { createPolicyModelServer } from './app.js';
import { POLICY_CONFIG_SCHEMA, policyModelConfig } from './config.js';
import { PolicyCoordinator } from './coordinator.js';

export const policyModelKind: ServerKindModule<'model'> = {
  kind: 'model',
  configSchema: { apps: { policy: POLICY_CONFIG_SCHEMA } },
  async fromStack(stack, name, options = {}) {
    const settings = serverOfKind(stack, name, 'model');
    const model = await createPolicyModelServer(settings, stack, {
      ...options,
      link: options.worker?.link,
    });
    if (model.worker) await options.worker!.link!.attach(model.worker);
    return listenGymServer(settings, model.app, options, {
      plane: model.plane,
      async close(listening) {
        model.plane?.dispose();
        const closed = listening.close();
        // Held generations never end by themselves; a drain must not wait for them.
        listening.server.closeAllConnections();
        await closed;
      },
    });
  },
  workers: {
    coordinator(stack, name, { expectedWorkers, logger }) {
      const settings = serverOfKind(stack, name, 'model');
      const capture = stack.tokenCapture.enabled;
      return new PolicyCoordinator({
        instance: name,
        expectedWorkers,
        ledgerDir: capture ? stack.tokenCapture.dir : undefined,
        generationCuts: capture && policyModelConfig(settings).checkpointGenerationCuts,
        logger,
      });
    },
  },
};
