/** The `model` server kind: what `ckpt-gym serve` and this package's bin start. */
import { listenGymServer, serverOfKind, type ServerKindModule } from '@ckpt-gym/core/server';

import { createPolicyModelServer } from './app.js';
import { POLICY_CONFIG_SCHEMA } from './config.js';

export const policyModelKind: ServerKindModule<'model'> = {
  kind: 'model',
  configSchema: { apps: { policy: POLICY_CONFIG_SCHEMA } },
  async fromStack(stack, name, options = {}) {
    const settings = serverOfKind(stack, name, 'model');
    const model = await createPolicyModelServer(settings, stack, options);
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
};
