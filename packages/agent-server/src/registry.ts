/** Stack-file apps of kind `agent`: `app: simple` is Simple Agent. */
import { ConfigError } from '@ckpt-gym/core/protocol';
import { dataPoolLimits, controlPoolLimits, type StackSettings } from '@ckpt-gym/core/server';

import type { AgentDefinition } from './agent.js';
import { type AgentServer, type AgentServerOptions, createAgentServer } from './app.js';
import { agentConfig } from './config.js';
import { simpleAgent } from './simple-agent.js';

export const AGENT_APPS: Readonly<Record<string, AgentDefinition<unknown>>> = {
  // Each definition only ever sees its own session table, so the state type is erased here.
  simple: simpleAgent as AgentDefinition<unknown>,
};

/** Builds the agent server the stack file names `name`. */
export function createAgentServerFromStack(
  stack: StackSettings,
  name: string,
  options: Pick<AgentServerOptions, 'logger' | 'routing' | 'link'> = {},
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
    routing: options.routing,
    link: options.link,
  });
}
