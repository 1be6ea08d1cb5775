/**
 * The `resources` server kind: what `ckpt-gym serve` and this package's bin start. With
 * `num_workers: N > 1` every forked worker routes each session's requests to the worker that owns
 * it (core's `SessionRouter`, on its own socket in the server's runtime directory), and with
 * checkpointing on the primary runs core's `SessionCoordinator` (the participant) and each worker
 * its `SessionWorker`, attached before it listens.
 */
import { ConfigError } from '@ckpt-gym/core/protocol';
import {
  type FromStackOptions,
  listenGymServer,
  newRoutingId,
  type ServerKindModule,
  serverSettings,
  SessionCoordinator,
  SessionWorker,
} from '@ckpt-gym/core/server';

import { createResourcesServer, type ResourcesServer } from './app.js';
import { definitionFor, RESOURCES_APPS, resourcesServerConfig } from './config.js';
import { checkDefinition } from './definition.js';
import { ResourcesParticipant, type ResourcesSessionRecord } from './participant.js';

/** Links a worker's participant and router to its coordinator, and serves its own socket. */
async function attachWorker(server: ResourcesServer, options: FromStackOptions): Promise<void> {
  const { router, participant } = server;
  if (!router) return;
  await router.listen(server.app);
  const link = options.worker?.link;
  if (link && participant) {
    await link.attach(new SessionWorker(participant, router, link, server.logger));
  }
}

export const resourcesKind: ServerKindModule<'resources'> = {
  kind: 'resources',
  configSchema: {
    apps: Object.fromEntries(
      Object.entries(RESOURCES_APPS).map(([app, { schema }]) => [app, schema]),
    ),
  },
  async fromStack(stack, name, options = {}) {
    const settings = serverSettings(stack, name);
    const config = resourcesServerConfig(settings);
    const worker = options.worker;
    if (worker && !config.sessionSecret && !stack.checkpoint) {
      throw new ConfigError(
        `servers.${name}.session_secret: required with num_workers > 1 and checkpointing off, ` +
          "or each worker signs with a secret of its own and refuses the others' cookies",
      );
    }
    // definitionFor refuses a server of another kind.
    const server = createResourcesServer(definitionFor(settings, stack.baseDir), {
      name,
      checkpoint: stack.checkpoint,
      logger: options.logger,
      ...config,
      ...(worker
        ? {
            routing: { routingId: newRoutingId(), socketDir: worker.runtimeDir },
            control: worker.link?.controlTarget(),
          }
        : {}),
    });
    await attachWorker(server, options);
    return listenGymServer(settings, server.app, options, {
      plane: server.plane,
      async close(listening) {
        server.plane?.dispose();
        await listening.close();
        await server.router?.close();
      },
    });
  },
  workers: {
    coordinator(stack, name, { expectedWorkers, logger }) {
      const settings = serverSettings(stack, name);
      const declarations = checkDefinition(definitionFor(settings, stack.baseDir));
      // Records are checked as the one-process participant checks them.
      const records = new ResourcesParticipant(name, declarations);
      return new SessionCoordinator<ResourcesSessionRecord>({
        kind: 'resources',
        instance: name,
        expectedWorkers,
        logger,
        records: {
          validateRecord: (record, key) => records.validateRecord(record, key),
          // A session's state spans requests: it is placed on a worker, never claimed.
          claimedByRequest: () => false,
          sessionOf: (record) => ({ id: record.session_id, owner: record.owner }),
          exportedFields: ['session_id', 'owner'],
        },
      });
    },
  },
};
