/**
 * The `app:` names a stack file may give a resources server, each with the schema of its keys
 * (checked when the stack file is loaded) and the definition built from them; and the keys every
 * resources server has (`session_secret`, `expose_tools_over_mcp`).
 */
import { resolve } from 'node:path';

import { ConfigError } from '@ckpt-gym/core/protocol';
import { type AppConfigSchema, MCP_EXPOSURE_KEY, type ServerSettings } from '@ckpt-gym/core/server';

import type { ResourcesServerDefinition } from './definition.js';
import { counterServer } from './servers/counter.js';
import { slowVerifyServer } from './servers/slow-verify.js';
import { exactMatchServer, multipleChoiceServer, numericMatchServer } from './servers/verifiers.js';
import { weatherRestartServer, weatherServer } from './servers/weather.js';

type Factory = (
  config: Readonly<Record<string, unknown>>,
  baseDir: string,
  where: string,
) => ResourcesServerDefinition;

function pathKey(
  config: Readonly<Record<string, unknown>>,
  key: string,
  baseDir: string,
  where: string,
): string {
  const value = config[key];
  if (typeof value !== 'string' || value === '') {
    throw new ConfigError(`${where}.${key}: required, a file path`);
  }
  return resolve(baseDir, value);
}

/** The keys of every resources app. */
const SERVER_KEYS = {
  session_secret: { type: 'string', minLength: 1 },
  [MCP_EXPOSURE_KEY]: { type: 'boolean' },
} as const;

function appSchema(
  properties: Record<string, object> = {},
  required: readonly string[] = [],
): AppConfigSchema {
  return { type: 'object', required, properties: { ...SERVER_KEYS, ...properties } };
}

interface ResourcesApp {
  readonly schema: AppConfigSchema;
  readonly build: Factory;
}

export const RESOURCES_APPS: Readonly<Record<string, ResourcesApp>> = {
  counter: { schema: appSchema(), build: () => counterServer() },
  weather: { schema: appSchema(), build: () => weatherServer() },
  weather_restart: { schema: appSchema(), build: () => weatherRestartServer() },
  slow_verify: {
    schema: appSchema(
      {
        flag_file: { type: 'string', minLength: 1 },
        verify_log: { type: 'string', minLength: 1 },
        checkpoint_verify: { type: 'string' },
      },
      ['flag_file', 'verify_log'],
    ),
    build: slowVerify,
  },
  exact_match: { schema: appSchema(), build: () => exactMatchServer() },
  multiple_choice: { schema: appSchema(), build: () => multipleChoiceServer() },
  numeric_match: { schema: appSchema(), build: () => numericMatchServer() },
};

/** `app: slow_verify`: its files resolve against the stack file's directory. */
function slowVerify(
  config: Readonly<Record<string, unknown>>,
  baseDir: string,
  where: string,
): ResourcesServerDefinition {
  const verify = config.checkpoint_verify;
  if (verify !== undefined && typeof verify !== 'string') {
    throw new ConfigError(`${where}.checkpoint_verify: must be a string`);
  }
  return slowVerifyServer({
    flagFile: pathKey(config, 'flag_file', baseDir, where),
    verifyLog: pathKey(config, 'verify_log', baseDir, where),
    checkpointVerify: verify,
  });
}

/** The definition a stack file's server names; relative paths resolve against `baseDir`. */
export function definitionFor(server: ServerSettings, baseDir: string): ResourcesServerDefinition {
  const where = `servers.${server.name}`;
  if (server.kind !== 'resources') {
    throw new ConfigError(`${where}: kind is '${server.kind}', not 'resources'`);
  }
  const app = Object.hasOwn(RESOURCES_APPS, server.app) ? RESOURCES_APPS[server.app] : undefined;
  if (!app) {
    throw new ConfigError(
      `${where}.app: '${server.app}' is not a resources app (one of ${Object.keys(RESOURCES_APPS).join(', ')})`,
    );
  }
  return app.build(server.config, baseDir, where);
}

/** The keys every resources server has, read and checked. */
export interface ResourcesServerConfig {
  /** Signs the session cookie, so another process of the same server accepts it. */
  readonly sessionSecret: string | undefined;
  readonly exposeToolsOverMcp: boolean;
}

export function resourcesServerConfig(server: ServerSettings): ResourcesServerConfig {
  const secret = server.config.session_secret;
  if (secret !== undefined && (typeof secret !== 'string' || secret === '')) {
    throw new ConfigError(`servers.${server.name}.session_secret: must be a non-empty string`);
  }
  return { sessionSecret: secret, exposeToolsOverMcp: server.config[MCP_EXPOSURE_KEY] === true };
}
