/**
 * The slow-verify example: the stateless weather server whose `/verify` blocks while a flag file
 * exists and appends one JSON line per verification to a log, so a test can hold a verification
 * in flight across a checkpoint and count how often it ran. Its verify mode comes from config.
 */
import { access, appendFile } from 'node:fs/promises';
import { setTimeout as sleep } from 'node:timers/promises';

import { captureKey } from '@ckpt-gym/core/protocol';

import type { ResourcesServerDefinition } from '../definition.js';
import { getWeather, WEATHER_TOOL, weatherReward } from './weather.js';

export const FLAG_POLL_MS = 50;

export interface SlowVerifyOptions {
  /** `/verify` waits while this file exists. */
  readonly flagFile: string;
  /** Each verification appends `{"session_id","episode","reward"}` here. */
  readonly verifyLog: string;
  /** `wait` (default) or `replay`; checked at startup like any declaration. */
  readonly checkpointVerify?: string;
}

async function exists(path: string): Promise<boolean> {
  try {
    await access(path);
    return true;
  } catch {
    return false;
  }
}

export function slowVerifyServer(options: SlowVerifyOptions): ResourcesServerDefinition {
  return {
    app: 'slow_verify',
    checkpointMode: 'stateless',
    checkpointVerify: options.checkpointVerify ?? 'wait',
    tools: { [WEATHER_TOOL]: getWeather },
    async verify(ctx) {
      while (await exists(options.flagFile))
        await sleep(FLAG_POLL_MS, undefined, { signal: ctx.signal });
      const reward = weatherReward(ctx);
      const line = {
        session_id: ctx.sessionId,
        episode: ctx.episode ? captureKey(ctx.episode) : null,
        reward,
      };
      await appendFile(options.verifyLog, `${JSON.stringify(line)}\n`);
      return { reward };
    },
  };
}
