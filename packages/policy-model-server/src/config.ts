/**
 * The app keys of a `kind: model` server: their schema (checked when the stack file is loaded)
 * and the typed config the server is built from.
 */
import { ConfigError } from '@ckpt-gym/core/protocol';
import { type AppConfigSchema, type ServerSettings } from '@ckpt-gym/core/server';

import { generationCutUrl } from './cuts.js';

/** `app: policy`, the one model app; `null` is the default, as the reader takes it. */
export const POLICY_CONFIG_SCHEMA: AppConfigSchema = {
  type: 'object',
  required: ['backend_url'],
  properties: {
    backend_url: { type: 'string' },
    checkpoint_policy: { type: ['boolean', 'null'] },
    checkpoint_generation_cuts: { type: ['boolean', 'null'] },
    generation_cut_control_url: { type: ['string', 'null'] },
    forward_rollout_prefix: { type: ['boolean', 'null'] },
    backend_api_key: { type: ['string', 'null'] },
    capture_control_token: { type: ['string', 'null'] },
  },
};

/** The app's own keys of a `kind: model` server in the stack file. */
export interface PolicyModelConfig {
  backendUrl: string;
  /** The server joins checkpoints (only with the global `checkpoint:` block enabled). */
  checkpointPolicy: boolean;
  checkpointGenerationCuts: boolean;
  /** Where the backend serves generation cuts (default: derived from `backendUrl`). */
  generationCutControlUrl: string;
  /** Forward `/ng-rollout/<key>` to the backend (default true; set false for a stock vLLM). */
  forwardRolloutPrefix: boolean;
  backendApiKey: string | undefined;
  /** Bearer of the capture-ledger control routes (default: the checkpoint control token). */
  captureControlToken: string | undefined;
}

function optional<T>(
  config: Readonly<Record<string, unknown>>,
  name: string,
  key: string,
  type: 'boolean' | 'string',
  fallback: T,
): T {
  const value = config[key];
  if (value === undefined || value === null) return fallback;
  if (typeof value !== type) {
    throw new ConfigError(
      `servers.${name}.${key}: must be a ${type}, got ${JSON.stringify(value)}`,
    );
  }
  return value as T;
}

/** Reads and checks the app's keys; a problem is a `ConfigError` naming the key. */
export function policyModelConfig(server: ServerSettings): PolicyModelConfig {
  const { config, name } = server;
  const backendUrl = config.backend_url;
  if (typeof backendUrl !== 'string' || !URL.canParse(backendUrl)) {
    throw new ConfigError(
      `servers.${name}.backend_url: a model server needs the backend's http(s) URL`,
    );
  }
  return {
    backendUrl,
    checkpointPolicy: optional(config, name, 'checkpoint_policy', 'boolean', false),
    checkpointGenerationCuts: optional(
      config,
      name,
      'checkpoint_generation_cuts',
      'boolean',
      false,
    ),
    generationCutControlUrl: optional(
      config,
      name,
      'generation_cut_control_url',
      'string',
      generationCutUrl(backendUrl),
    ),
    forwardRolloutPrefix: optional(config, name, 'forward_rollout_prefix', 'boolean', true),
    backendApiKey: optional<string | undefined>(
      config,
      name,
      'backend_api_key',
      'string',
      undefined,
    ),
    captureControlToken: optional<string | undefined>(
      config,
      name,
      'capture_control_token',
      'string',
      undefined,
    ),
  };
}
