/** The `resources` server kind: what `ckpt-gym serve` and this package's bin start. */
import { listenGymServer, serverSettings, type ServerKindModule } from '@ckpt-gym/core/server';

import { createResourcesServer } from './app.js';
import { definitionFor, RESOURCES_APPS, resourcesServerConfig } from './config.js';

export const resourcesKind: ServerKindModule<'resources'> = {
  kind: 'resources',
  configSchema: {
    apps: Object.fromEntries(
      Object.entries(RESOURCES_APPS).map(([app, { schema }]) => [app, schema]),
    ),
  },
  async fromStack(stack, name, options = {}) {
    const settings = serverSettings(stack, name);
    // definitionFor refuses a server of another kind.
    const server = createResourcesServer(definitionFor(settings, stack.baseDir), {
      name,
      checkpoint: stack.checkpoint,
      logger: options.logger,
      ...resourcesServerConfig(settings),
    });
    return listenGymServer(settings, server.app, options, {
      plane: server.plane,
      async close(listening) {
        server.plane?.dispose();
        await listening.close();
      },
    });
  },
};
