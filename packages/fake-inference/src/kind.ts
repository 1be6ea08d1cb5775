/** The `inference` server kind (the fake backend): what `ckpt-gym serve` starts. */
import { serverOfKind, type ServerKindModule } from '@ckpt-gym/core/server';

import { startFakeInference } from './app.js';
import { FAKE_INFERENCE_APP, FAKE_INFERENCE_CONFIG_SCHEMA, fakeInferenceConfig } from './config.js';

export const fakeInferenceKind: ServerKindModule<'inference'> = {
  kind: 'inference',
  // Any other app is an external backend (vLLM…): its keys are its own.
  configSchema: {
    apps: { [FAKE_INFERENCE_APP]: FAKE_INFERENCE_CONFIG_SCHEMA },
  },
  async fromStack(stack, name, options = {}) {
    const settings = serverOfKind(stack, name, 'inference');
    const fake = await startFakeInference({
      name,
      port: options.port ?? settings.port,
      host: settings.host,
      ...fakeInferenceConfig(settings),
    });
    return {
      name,
      kind: 'inference',
      app: fake.app,
      plane: undefined,
      host: fake.host,
      port: fake.port,
      url: fake.url,
      close: () => fake.close(),
    };
  },
};
