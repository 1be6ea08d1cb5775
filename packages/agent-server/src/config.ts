/**
 * The app keys of a `kind: agent` server: their schema (checked when the stack file is loaded),
 * and the config an agent is built from. Server names in an agent's settings (`model_server`,
 * `resources_server`) are resolved to base URLs here, so agents only ever see URLs.
 */
import { ConfigError } from '@ckpt-gym/core/protocol';
import {
  type AppConfigSchema,
  type ServerSettings,
  type StackSettings,
} from '@ckpt-gym/core/server';

/** `app: simple`; `null` is the default, as `simpleAgentConfig` takes it. */
export const SIMPLE_AGENT_CONFIG_SCHEMA: AppConfigSchema = {
  type: 'object',
  required: ['model_server'],
  properties: {
    model_server: { type: 'string' },
    resources_server: { type: ['string', 'null'] },
    max_steps: { type: ['integer', 'null'], minimum: 1 },
    skip_verification: { type: ['boolean', 'null'] },
    skip_verification_reward: { type: ['number', 'null'] },
    tool_transport: { type: ['string', 'null'], enum: ['direct_http', 'mcp', null] },
  },
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

export interface SimpleAgentConfig {
  skipVerification: boolean;
  skipVerificationReward: number;
  /** Base URL of the policy model server (its Responses API is at `/v1/responses`). */
  modelServerUrl: string;
  /** Base URL of the resources server, for legacy `/run` episodes. */
  resourcesServerUrl: string | null;
  maxSteps: number | null;
  /** Which of the seed's tool grants the agent calls its tools through. */
  toolTransport: ToolTransport;
}

export type ToolTransport = 'direct_http' | 'mcp';

/**
 * Reads `model_server`, `resources_server` (resolved to URLs, see `agentConfig`), `max_steps` and
 * `tool_transport`.
 */
export function simpleAgentConfig(config: Readonly<Record<string, unknown>>): SimpleAgentConfig {
  const model = config.model_server_url;
  const resources = config.resources_server_url ?? null;
  const maxSteps = config.max_steps ?? null;
  if (typeof model !== 'string') throw new ConfigError('simple agent: model_server is required');
  if (resources !== null && typeof resources !== 'string') {
    throw new ConfigError('simple agent: resources_server must name a server');
  }
  if (
    maxSteps !== null &&
    (typeof maxSteps !== 'number' || !Number.isInteger(maxSteps) || maxSteps < 1)
  ) {
    throw new ConfigError('simple agent: max_steps must be a positive integer');
  }
  const skip = config.skip_verification ?? false;
  const reward = config.skip_verification_reward ?? 0;
  if (typeof skip !== 'boolean' || typeof reward !== 'number') {
    throw new ConfigError(
      'simple agent: skip_verification is a bool, skip_verification_reward a number',
    );
  }
  const transport = config.tool_transport ?? 'direct_http';
  if (transport !== 'direct_http' && transport !== 'mcp') {
    throw new ConfigError('simple agent: tool_transport must be "direct_http" or "mcp"');
  }
  return {
    modelServerUrl: model,
    resourcesServerUrl: resources,
    maxSteps,
    skipVerification: skip,
    skipVerificationReward: reward,
    toolTransport: transport,
  };
}
