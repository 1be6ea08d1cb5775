/**
 * The official openai SDK obeys `x-should-retry` before its own status rule (which resends every
 * 409 and 5xx): a refusal whose catalogue rule is `never` is sent once, a retryable one is resent.
 */
import { deadline, episodes } from '@ckpt-gym/testing';
import { afterEach, describe, expect, it } from '@jest/globals';
import OpenAI from 'openai';

import {
  CHAT_BODY,
  cleanup,
  closedPort,
  control,
  countRequests,
  fakeCalls,
  startHarness,
  TOKEN,
} from './support.js';

afterEach(cleanup);

const CHAT_PATH = '/ng-rollout/r/v1/chat/completions';

describe('the openai SDK with maxRetries: 2', () => {
  it('sends a stale_attempt refusal (a retired attempt) exactly once', async () => {
    const h = await startHarness();
    const retired = await control(h.url, 'retire', {
      checkpoint_id: 'c0',
      deadline_ts: deadline(),
      episode_ids: episodes('r'),
    });
    expect(retired.status).toBe(200);
    const requests = countRequests(h, CHAT_PATH);
    const openai = new OpenAI({ baseURL: `${h.url}/ng-rollout/r/v1`, apiKey: 'x', maxRetries: 2 });
    await expect(openai.chat.completions.create(CHAT_BODY as never)).rejects.toMatchObject({
      status: 409,
      error: { code: 'stale_attempt' },
    });
    expect(requests()).toBe(1);
    expect(await fakeCalls(h.fake)).toEqual([]);
  });

  it('resends an admission_closed refusal (after_resume): 3 requests while the checkpoint stays open', async () => {
    const h = await startHarness();
    const prepared = await control(h.url, 'prepare', {
      checkpoint_id: 'c1',
      deadline_ts: deadline(),
    });
    expect(prepared.status).toBe(200);
    const path = '/training-token-capture/control/rollouts/retire';
    const requests = countRequests(h, path);
    // The capture control routes take the control token as their bearer: the SDK's API key.
    const openai = new OpenAI({ baseURL: h.url, apiKey: TOKEN, maxRetries: 2 });
    await expect(openai.post(path, { body: { rollout_ids: ['r'] } })).rejects.toMatchObject({
      status: 409,
      error: { code: 'admission_closed' },
    });
    expect(requests()).toBe(3);
  });

  it('resends a 502 upstream_error (backoff) with the backend down: 3 requests', async () => {
    const backendUrl = `http://127.0.0.1:${await closedPort()}/v1`;
    const h = await startHarness({ backendUrl });
    const requests = countRequests(h, CHAT_PATH);
    const openai = new OpenAI({ baseURL: `${h.url}/ng-rollout/r/v1`, apiKey: 'x', maxRetries: 2 });
    await expect(openai.chat.completions.create(CHAT_BODY as never)).rejects.toMatchObject({
      status: 502,
      error: { code: 'upstream_error' },
    });
    expect(requests()).toBe(3);
  });
});
