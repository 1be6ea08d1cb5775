/** The `environment` server kind: what `ckpt-gym serve` and this package's bin start. */
import { listenGymServer, type ServerKindModule } from '@ckpt-gym/core/server';

import { ENVIRONMENT_APPS, ENVIRONMENT_CONFIG_SCHEMA } from './config.js';
import { environmentServerFromStack } from './registry.js';

export const environmentKind: ServerKindModule<'environment'> = {
  kind: 'environment',
  configSchema: {
    apps: Object.fromEntries(ENVIRONMENT_APPS.map((app) => [app, ENVIRONMENT_CONFIG_SCHEMA])),
  },
  async fromStack(stack, name, options = {}) {
    const { server, settings, clients } = environmentServerFromStack(stack, name, options);
    return listenGymServer(settings, server.app, options, {
      plane: server.plane,
      async close(listening) {
        server.plane?.dispose();
        await listening.close();
        clients.close();
      },
    });
  },
};
