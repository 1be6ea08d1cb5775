/**
 * The `app:` names a stack file may give a resources server, each with the app's own config keys.
 */
import { resolve } from 'node:path';

import { ConfigError, type ServerSettings } from '@ckpt-gym/core';

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

export const RESOURCES_APPS: Readonly<Record<string, Factory>> = {
  counter: () => counterServer(),
  weather: () => weatherServer(),
  weather_restart: () => weatherRestartServer(),
  slow_verify: (config, baseDir, where) => {
    const verify = config.checkpoint_verify;
    if (verify !== undefined && typeof verify !== 'string') {
      throw new ConfigError(`${where}.checkpoint_verify: must be a string`);
    }
    return slowVerifyServer({
      flagFile: pathKey(config, 'flag_file', baseDir, where),
      verifyLog: pathKey(config, 'verify_log', baseDir, where),
      checkpointVerify: verify,
    });
  },
  exact_match: () => exactMatchServer(),
  multiple_choice: () => multipleChoiceServer(),
  numeric_match: () => numericMatchServer(),
};

/** The definition a stack file's server names; relative paths resolve against `baseDir`. */
export function definitionFor(server: ServerSettings, baseDir: string): ResourcesServerDefinition {
  const where = `servers.${server.name}`;
  if (server.kind !== 'resources') {
    throw new ConfigError(`${where}: kind is '${server.kind}', not 'resources'`);
  }
  const factory = Object.hasOwn(RESOURCES_APPS, server.app)
    ? RESOURCES_APPS[server.app]
    : undefined;
  if (!factory) {
    throw new ConfigError(
      `${where}.app: '${server.app}' is not a resources app (one of ${Object.keys(RESOURCES_APPS).join(', ')})`,
    );
  }
  return factory(server.config, baseDir, where);
}
