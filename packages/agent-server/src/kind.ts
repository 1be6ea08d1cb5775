/** The `agent` server kind: what `ckpt-gym serve` and this package's bin start. */
import { listenGymServer, serverOfKind, type ServerKindModule } from '@ckpt-gym/core/server';

import { SIMPLE_AGENT_CONFIG_SCHEMA } from './config.js';
import { createAgentServerFromStack } from './registry.js';

export const agentKind: ServerKindModule<'agent'> = {
  kind: 'agent',
  configSchema: { apps: { simple: SIMPLE_AGENT_CONFIG_SCHEMA } },
  async fromStack(stack, name, options = {}) {
    const settings = serverOfKind(stack, name, 'agent');
    const agent = createAgentServerFromStack(stack, name, options);
    return listenGymServer(settings, agent.app, options, {
      plane: agent.gym.plane,
      async close(listening) {
        await listening.close();
        agent.close();
      },
    });
  },
};
