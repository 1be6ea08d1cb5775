/**
 * The app keys of a `kind: environment` server: `app: single_agent_turn` (native `/run`) or
 * `app: single_agent_turn_legacy` (flat rows), with the keys `agent_server`, `resources_server`,
 * `max_concurrent_episodes`, `queue_timeout_seconds`, `episode_deadline_seconds`,
 * `cleanup_timeout_seconds` and `resources_tool_transports`: their schema (checked when the stack
 * file is loaded) and the typed config the server is built from.
 */
import { ConfigError } from '@ckpt-gym/core/protocol';
import { type AppConfigSchema, type ServerSettings } from '@ckpt-gym/core/server';

import { DEFAULT_CLEANUP_TIMEOUT_SECONDS, type QueueOptions } from './app.js';
import type { ToolTransport } from './single-agent-turn.js';

const positive = { exclusiveMinimum: 0 } as const;

/** Both apps take the same keys; `null` is the default where `environmentConfig` takes it. */
export const ENVIRONMENT_CONFIG_SCHEMA: AppConfigSchema = {
  type: 'object',
  required: ['agent_server', 'resources_server'],
  properties: {
    agent_server: { type: 'string' },
    resources_server: { type: 'string' },
    max_concurrent_episodes: { type: ['integer', 'null'], minimum: 1 },
    queue_timeout_seconds: { type: ['number', 'null'], ...positive },
    episode_deadline_seconds: { type: ['number', 'null'], ...positive },
    cleanup_timeout_seconds: { type: 'number', ...positive },
    resources_tool_transports: {
      type: 'array',
      items: { type: 'string', enum: ['direct_http', 'mcp'] },
    },
  },
};

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
