/**
 * Starting one resources server of a stack file: what `main.ts` runs, as a function a test can call.
 */
import {
  ConfigError,
  type Env,
  listen,
  type ListeningServer,
  loadStackFile,
  type Logger,
  MCP_EXPOSURE_KEY,
} from '@ckpt-gym/core';

import { createResourcesServer, type ResourcesServer } from './app.js';
import { definitionFor } from './registry.js';

export interface StartedResourcesServer {
  readonly server: ResourcesServer;
  readonly listening: ListeningServer;
  /** Stops the control plane's timers, stops accepting, and waits for requests in flight. */
  close(): Promise<void>;
}

export async function startFromStackFile(
  configPath: string,
  serverName: string,
  options: { env?: Env; logger?: Logger } = {},
): Promise<StartedResourcesServer> {
  const stack = loadStackFile(configPath, options.env);
  const settings = stack.servers.get(serverName);
  if (!settings) throw new ConfigError(`server '${serverName}' is not in ${stack.source}`);
  const secret = settings.config.session_secret;
  if (secret !== undefined && (typeof secret !== 'string' || secret === '')) {
    throw new ConfigError(`servers.${serverName}.session_secret: must be a non-empty string`);
  }
  const server = createResourcesServer(definitionFor(settings, stack.baseDir), {
    name: settings.name,
    checkpoint: stack.checkpoint,
    logger: options.logger,
    exposeToolsOverMcp: settings.config[MCP_EXPOSURE_KEY] === true,
    sessionSecret: secret,
  });
  const listening = await listen(server.app, settings.port, settings.host);
  return {
    server,
    listening,
    close: async () => {
      server.plane?.dispose();
      await listening.close();
    },
  };
}
