import { ConfigError } from '@ckpt-gym/core/protocol';
import { createLogger, parseStackFile } from '@ckpt-gym/core/server';

import { AgentParticipant } from '../src/participant.js';
import { agentConfig } from '../src/config.js';
import { createAgentServerFromStack } from '../src/registry.js';
import type { SimpleAgent } from '../src/simple-agent.js';

const STACK = `
checkpoint: { enabled: true, control_auth_token: tok }
servers:
  policy:       { kind: model,     app: policy, port: 8101, backend_url: http://127.0.0.1:8100/v1 }
  weather:      { kind: resources, app: weather, port: 8102 }
  simple_agent: { kind: agent,     app: simple, port: 8103, model_server: policy, resources_server: weather, max_steps: 3 }
  odd_agent:    { kind: agent,     app: mystery, port: 8104, model_server: policy }
`;

const quiet = createLogger({ level: 'error' });

describe('registry', () => {
  test('app simple is Simple Agent, with its servers resolved to URLs and max_steps read', () => {
    const stack = parseStackFile(STACK);
    const config = agentConfig(stack, stack.servers.get('simple_agent')!);
    expect(config).toEqual(
      expect.objectContaining({
        model_server_url: 'http://127.0.0.1:8101',
        resources_server_url: 'http://127.0.0.1:8102',
        max_steps: 3,
      }),
    );
    const server = createAgentServerFromStack(stack, 'simple_agent', { logger: quiet });
    expect(server.participant).toBeInstanceOf(AgentParticipant);
    expect((server.agent as unknown as SimpleAgent).config.maxSteps).toBe(3);
    server.close();
  });

  test('an unknown agent app or a server of another kind is a ConfigError', () => {
    const stack = parseStackFile(STACK);
    expect(() => createAgentServerFromStack(stack, 'odd_agent', { logger: quiet })).toThrow(
      ConfigError,
    );
    expect(() => createAgentServerFromStack(stack, 'weather', { logger: quiet })).toThrow(
      /not agent/,
    );
  });
});
