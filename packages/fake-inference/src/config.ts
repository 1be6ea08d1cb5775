/**
 * The app keys of a `kind: inference, app: fake` server: their schema (checked when the stack file
 * is loaded) and the options the fake is started with.
 */
import { ConfigError } from '@ckpt-gym/core/protocol';
import { type AppConfigSchema, type ServerSettings } from '@ckpt-gym/core/server';

import { SCRIPTS, type ScriptName } from './script.js';

/** The inference app ckpt-gym runs itself; any other inference entry is an external backend. */
export const FAKE_INFERENCE_APP = 'fake';

export const FAKE_INFERENCE_CONFIG_SCHEMA: AppConfigSchema = {
  type: 'object',
  properties: {
    model: { type: 'string' },
    script: { type: 'string', enum: Object.keys(SCRIPTS) },
  },
};

export interface FakeInferenceConfig {
  readonly model?: string;
  readonly script?: ScriptName;
}

/** The fake's keys, read and checked; an external backend is not ours to run. */
export function fakeInferenceConfig(server: ServerSettings): FakeInferenceConfig {
  if (server.app !== FAKE_INFERENCE_APP) {
    throw new ConfigError(
      `servers.${server.name}: inference app '${server.app}' is an external backend; ` +
        `only app: ${FAKE_INFERENCE_APP} can be served`,
    );
  }
  const { model, script } = server.config;
  if (script !== undefined && (typeof script !== 'string' || !Object.hasOwn(SCRIPTS, script))) {
    throw new ConfigError(
      `servers.${server.name}.script: must be one of ${Object.keys(SCRIPTS).join(', ')}`,
    );
  }
  return {
    ...(typeof model === 'string' ? { model } : {}),
    ...(script === undefined ? {} : { script: script as ScriptName }),
  };
}
