/**
 * Building an environment server from the stack file: `app: single_agent_turn` (native `/run`) or
 * `app: single_agent_turn_legacy` (flat rows), with the config keys `agent_server`,
 * `resources_server`, `max_concurrent_episodes`, `queue_timeout_seconds`,
 * `episode_deadline_seconds`, `cleanup_timeout_seconds` and `resources_tool_transports`.
 */
import {
  ConfigError,
  createHttpClients,
  dataPoolLimits,
  controlPoolLimits,
  type HttpClients,
  type Logger,
  type ServerSettings,
  serverSettings,
  serverUrl,
  type StackSettings,
} from '@ckpt-gym/core';

import {
  createEnvironmentServer,
  DEFAULT_CLEANUP_TIMEOUT_SECONDS,
  type EnvironmentServer,
  type QueueOptions,
} from './app.js';
import { SingleAgentTurn, type ToolTransport } from './single-agent-turn.js';

export const ENVIRONMENT_APPS = ['single_agent_turn', 'single_agent_turn_legacy'] as const;
export type EnvironmentApp = (typeof ENVIRONMENT_APPS)[number];

/** The app's own settings, validated. */
export interface EnvironmentConfig {
  readonly app: EnvironmentApp;
  readonly agentServer: string;
  readonly resourcesServer: string;
  readonly queue: QueueOptions | undefined;
  readonly episodeDeadlineSeconds: number | null;
  readonly cleanupTimeoutSeconds: number;
  readonly toolTransports: readonly ToolTransport[];
}

function positiveNumber(value: unknown): value is number {
  return typeof value === 'number' && Number.isFinite(value) && value > 0;
}

/** Validates an environment server's entry; every problem is named in one `ConfigError`. */
export function environmentConfig(server: ServerSettings): EnvironmentConfig {
  const c = server.config;
  const where = `servers.${server.name}`;
  const problems: string[] = [];
  if (!(ENVIRONMENT_APPS as readonly string[]).includes(server.app)) {
    problems.push(
      `app: must be one of ${ENVIRONMENT_APPS.join(', ')} (got ${JSON.stringify(server.app)})`,
    );
  }
  for (const key of ['agent_server', 'resources_server']) {
    if (typeof c[key] !== 'string') problems.push(`${key}: required (the name of a server)`);
  }
  const max = c.max_concurrent_episodes;
  const queueTimeout = c.queue_timeout_seconds;
  if (max !== undefined && max !== null && !(Number.isSafeInteger(max) && (max as number) >= 1)) {
    problems.push('max_concurrent_episodes: must be an integer ≥ 1');
  }
  if (max != null && !positiveNumber(queueTimeout)) {
    problems.push(
      'queue_timeout_seconds: required (a number > 0) when max_concurrent_episodes is set',
    );
  }
  const deadline = c.episode_deadline_seconds;
  if (deadline != null && !positiveNumber(deadline)) {
    problems.push('episode_deadline_seconds: must be a number > 0 or null');
  }
  const cleanup = c.cleanup_timeout_seconds;
  if (cleanup !== undefined && !positiveNumber(cleanup)) {
    problems.push('cleanup_timeout_seconds: must be a number > 0');
  }
  const transports = c.resources_tool_transports ?? ['direct_http'];
  if (!Array.isArray(transports) || !transports.every((t) => t === 'direct_http' || t === 'mcp')) {
    problems.push('resources_tool_transports: must be a list of "direct_http" and "mcp"');
  }
  if (problems.length > 0) {
    throw new ConfigError(problems.map((p) => `${where}.${p}`).join('\n'));
  }
  return {
    app: server.app as EnvironmentApp,
    agentServer: c.agent_server as string,
    resourcesServer: c.resources_server as string,
    queue:
      max == null
        ? undefined
        : { maxConcurrentEpisodes: max as number, queueTimeoutSeconds: queueTimeout as number },
    episodeDeadlineSeconds: (deadline as number | null | undefined) ?? null,
    cleanupTimeoutSeconds: (cleanup as number | undefined) ?? DEFAULT_CLEANUP_TIMEOUT_SECONDS,
    toolTransports: transports as ToolTransport[],
  };
}

export interface StackEnvironmentServer {
  readonly server: EnvironmentServer;
  readonly settings: ServerSettings;
  readonly clients: HttpClients;
}

/** The named environment server of a stack file, with its HTTP clients. */
export function environmentServerFromStack(
  stack: StackSettings,
  name: string,
  options: { logger?: Logger } = {},
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
    numWorkers: settings.numWorkers,
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
