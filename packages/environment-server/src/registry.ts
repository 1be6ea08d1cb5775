/** Building an environment server from the stack file (its keys: config.ts). */
import { createHttpClients, type HttpClients } from '@ckpt-gym/core/client';
import { ConfigError } from '@ckpt-gym/core/protocol';
import {
  dataPoolLimits,
  controlPoolLimits,
  type Logger,
  type ServerSettings,
  serverSettings,
  serverUrl,
  type StackSettings,
  type WorkerLink,
} from '@ckpt-gym/core/server';

import { createEnvironmentServer, type EnvironmentServer } from './app.js';
import { environmentConfig } from './config.js';
import { SingleAgentTurn } from './single-agent-turn.js';

export interface StackEnvironmentServer {
  readonly server: EnvironmentServer;
  readonly settings: ServerSettings;
  readonly clients: HttpClients;
}

/** The named environment server of a stack file, with its HTTP clients. */
export function environmentServerFromStack(
  stack: StackSettings,
  name: string,
  options: { logger?: Logger; link?: WorkerLink | undefined } = {},
): StackEnvironmentServer {
  const settings = serverSettings(stack, name);
  if (settings.kind !== 'environment') {
    throw new ConfigError(`servers.${name}: kind is ${settings.kind}, not environment`);
  }
  const config = environmentConfig(settings);
  const clients = createHttpClients({
    data: dataPoolLimits(stack),
    control: controlPoolLimits(stack),
  });
  const checkpointing = stack.checkpoint !== undefined;
  const protocol = new SingleAgentTurn({
    agentUrl: serverUrl(stack, config.agentServer),
    resourcesUrl: serverUrl(stack, config.resourcesServer),
    resourcesName: config.resourcesServer,
    client: clients.data,
    checkpointing,
    toolTransports: config.toolTransports,
    ...(options.logger ? { logger: options.logger } : {}),
  });
  const server = createEnvironmentServer({
    name,
    protocol,
    ...(stack.checkpoint ? { checkpoint: stack.checkpoint } : {}),
    link: options.link,
    ...(config.queue ? { queue: config.queue } : {}),
    episodeDeadlineSeconds: config.episodeDeadlineSeconds,
    cleanupTimeoutSeconds: config.cleanupTimeoutSeconds,
    ...(config.app === 'single_agent_turn_legacy'
      ? { legacy: { defaultTaskset: config.resourcesServer } }
      : {}),
    ...(options.logger ? { logger: options.logger } : {}),
  });
  return { server, settings, clients };
}
