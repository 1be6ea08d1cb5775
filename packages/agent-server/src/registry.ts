/**
 * Stack-file apps of kind `agent`: `app: simple` is Simple Agent. Server names in an agent's
 * settings (`model_server`, `resources_server`) are resolved to base URLs here, so agents only
 * ever see URLs.
 */
import {
  ConfigError,
  dataPoolLimits,
  controlPoolLimits,
  type Logger,
  type ServerSettings,
  type StackSettings,
} from '@ckpt-gym/core';

import type { AgentDefinition } from './agent.js';
import { type AgentServer, createAgentServer } from './app.js';
import { simpleAgent } from './simple-agent.js';

export const AGENT_APPS: Readonly<Record<string, AgentDefinition<unknown>>> = {
  // Each definition only ever sees its own session table, so the state type is erased here.
  simple: simpleAgent as AgentDefinition<unknown>,
};

/** `http://host:port` of a server in the stack; a server that picks its port at startup cannot be named. */
export function serverUrl(stack: StackSettings, name: string, from: string): string {
  const server = stack.servers.get(name);
  if (!server) throw new ConfigError(`servers.${from}: names no server '${name}'`);
  if (server.port === 0) {
    throw new ConfigError(
      `servers.${from}: server '${name}' has port 0, so its address is not known in advance`,
    );
  }
  const host =
    server.host === '0.0.0.0'
      ? '127.0.0.1'
      : server.host.includes(':')
        ? `[${server.host}]`
        : server.host;
  return `http://${host}:${server.port}`;
}

/** The agent's settings with `model_server` / `resources_server` resolved to `…_url`. */
export function agentConfig(stack: StackSettings, server: ServerSettings): Record<string, unknown> {
  const config: Record<string, unknown> = { ...server.config };
  for (const key of ['model_server', 'resources_server'] as const) {
    const name = config[key];
    if (typeof name === 'string')
      config[`${key}_url`] = serverUrl(stack, name, `${server.name}.${key}`);
  }
  return config;
}

/** Builds the agent server the stack file names `name`. */
export function createAgentServerFromStack(
  stack: StackSettings,
  name: string,
  options: { logger?: Logger } = {},
): AgentServer<unknown> {
  const server = stack.servers.get(name);
  if (!server) throw new ConfigError(`${stack.source}: no server named '${name}'`);
  if (server.kind !== 'agent') {
    throw new ConfigError(`${stack.source}: server '${name}' is of kind ${server.kind}, not agent`);
  }
  const definition = AGENT_APPS[server.app];
  if (!definition) {
    throw new ConfigError(
      `${stack.source}: servers.${name}.app: unknown agent app '${server.app}' (known: ${Object.keys(AGENT_APPS).join(', ')})`,
    );
  }
  return createAgentServer(definition, {
    name,
    checkpoint: stack.checkpoint,
    config: agentConfig(stack, server),
    httpLimits: { data: dataPoolLimits(stack), control: controlPoolLimits(stack) },
    ...(options.logger ? { logger: options.logger } : {}),
  });
}
