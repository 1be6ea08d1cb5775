import { describe, expect, it } from '@jest/globals';
import { parseStackFile, serverSettings } from '@ckpt-gym/core/server';

import { backendTarget, policyModelConfig } from '../src/index.js';

const server = (extra: string) =>
  serverSettings(
    parseStackFile(`servers:\n  policy: { kind: model, app: policy, port: 0${extra} }`),
    'policy',
  );

describe('policy model config', () => {
  it('reads the app keys with their defaults', () => {
    expect(policyModelConfig(server(', backend_url: "http://h:1/v1"'))).toEqual({
      backendUrl: 'http://h:1/v1',
      checkpointPolicy: false,
      checkpointGenerationCuts: false,
      generationCutControlUrl: 'http://h:1/ng-control/v1/generation-cut',
      forwardRolloutPrefix: true,
      backendApiKey: undefined,
      captureControlToken: undefined,
    });
  });

  it('refuses a server without a backend_url or with a mistyped key, naming the key', () => {
    expect(() => policyModelConfig(server(''))).toThrow(/servers\.policy\.backend_url/);
    expect(() =>
      policyModelConfig(server(', backend_url: "http://h:1/v1", forward_rollout_prefix: "yes"')),
    ).toThrow(/servers\.policy\.forward_rollout_prefix: must be a boolean/);
  });
});

describe('backendTarget', () => {
  it('puts the rollout prefix at the root of the backend URL, before its base path', () => {
    expect(backendTarget('http://h:1/v1/', 'r-a1', '/chat/completions', true)).toBe(
      'http://h:1/ng-rollout/r-a1/v1/chat/completions',
    );
    expect(backendTarget('http://h:1/v1', 'r-a1', '/chat/completions', false)).toBe(
      'http://h:1/v1/chat/completions',
    );
    expect(backendTarget('http://h:1/v1', undefined, '/models', true)).toBe('http://h:1/v1/models');
  });
});
