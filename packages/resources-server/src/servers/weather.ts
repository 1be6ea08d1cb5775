/**
 * The weather examples: one tool, `get_weather {city}` → `{city, forecast}`, whose result depends
 * only on the request. Reward 1.0 when the agent called `get_weather`. `weather` is `stateless`;
 * `weather_restart` is the same server left `restart_only`.
 */
import { InvalidRequestError, type JsonObject } from '@ckpt-gym/core/protocol';

import type { ResourcesServerDefinition, ToolHandler, VerifyContext } from '../definition.js';
import { calledTools } from '../responses.js';

export const WEATHER_TOOL = 'get_weather';

export function forecastFor(city: string): JsonObject {
  return { city, forecast: 'sunny' };
}

export const getWeather: ToolHandler = ({ body }) => {
  if (typeof body.city !== 'string' || body.city === '') {
    throw new InvalidRequestError('city: must be a non-empty string');
  }
  return forecastFor(body.city);
};

export function weatherReward({ response }: Pick<VerifyContext, 'response'>): number {
  return calledTools(response).includes(WEATHER_TOOL) ? 1.0 : 0.0;
}

export function weatherServer(): ResourcesServerDefinition {
  return {
    app: 'weather',
    checkpointMode: 'stateless',
    tools: { [WEATHER_TOOL]: getWeather },
    verify: (ctx) => ({ reward: weatherReward(ctx) }),
  };
}

export function weatherRestartServer(): ResourcesServerDefinition {
  return {
    app: 'weather_restart',
    checkpointMode: 'restart_only',
    tools: { [WEATHER_TOOL]: getWeather },
    verify: (ctx) => ({ reward: weatherReward(ctx) }),
  };
}
