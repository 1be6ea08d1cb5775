import { gzipSync } from 'node:zlib';

import { MAX_SESSION_ID_CHARS as MAX_RESOURCES_SESSION_ID_CHARS } from '@ckpt-gym/core/protocol';

import { counterServer, exactMatchServer, SessionCookie, weatherServer } from '../src/index.js';
import { probeServer } from './probe.js';
import { episodeJson, responseCalling, startServer } from './support.js';

function nativeSeed(id: string, key: string, taskData: object = {}) {
  return {
    resources_session_id: id,
    episode_id: episodeJson(key),
    task_id: { taskset: 'ts', task_id: 't1' },
    task_data: taskData,
  };
}

describe('sessions without checkpointing', () => {
  test('a native seed replies with its session id and sets the signed cookie naming it', async () => {
    const counter = counterServer();
    await using server = await startServer(counter, { checkpoint: false });
    const reply = await server.post('/seed_session', nativeSeed('s1', 'r1', { initial_count: 4 }), {
      key: 'r1',
    });
    expect(reply.status).toBe(200);
    expect(reply.body).toEqual({
      resources_session_id: 's1',
      resources_tools: null,
      sandbox_access: null,
    });
    const got = await server.post('/get_counter_value', {}, { key: 'r1', cookie: reply.setCookie });
    expect(got.body).toEqual({ count: 4 });
  });

  test('a native seed is idempotent per id: a repeat returns the same session without seeding again', async () => {
    const probe = probeServer();
    await using server = await startServer(probe, { checkpoint: false });
    const first = await server.post('/seed_session', nativeSeed('s1', 'r1'), { key: 'r1' });
    const second = await server.post('/seed_session', nativeSeed('s1', 'r1'), { key: 'r1' });
    expect([first.status, second.status]).toEqual([200, 200]);
    expect(second.body.resources_session_id).toBe('s1');
    expect(probe.calls.seed).toBe(1);
  });

  test('a native seed of the same id with other task data or another episode is refused', async () => {
    await using server = await startServer(probeServer(), { checkpoint: false });
    await server.post('/seed_session', nativeSeed('s1', 'r1', { a: 1 }), { key: 'r1' });
    const otherTask = await server.post('/seed_session', nativeSeed('s1', 'r1', { a: 2 }), {
      key: 'r1',
    });
    const otherEpisode = await server.post('/seed_session', nativeSeed('s1', 'r2'), { key: 'r2' });
    expect(otherTask.status).toBe(422);
    expect(otherEpisode.status).toBe(422);
    expect(otherEpisode.body.error).toMatchObject({ code: 'invalid_request' });
  });

  test.each([
    ['a lone surrogate, which no cookie can name', '\ud800'],
    ['too long for its cookie', 's'.repeat(MAX_RESOURCES_SESSION_ID_CHARS + 1)],
  ])('a resources_session_id that is %s is 422 before any session exists', async (_what, id) => {
    const probe = probeServer();
    await using server = await startServer(probe, { checkpoint: false });
    const seed = await server.post('/seed_session', nativeSeed(id, 'r1'), { key: 'r1' });
    expect([seed.status, seed.body.error]).toEqual([
      422,
      expect.objectContaining({ code: 'invalid_request' }),
    ]);
    expect(probe.calls.seed).toBe(0);
    const close = { resources_session_id: id, episode_id: episodeJson('r1') };
    expect((await server.post('/close_session', close, { key: 'r1' })).status).toBe(422);
  });

  test('a native body whose episode differs from its rollout prefix is refused', async () => {
    await using server = await startServer(probeServer(), { checkpoint: false });
    const reply = await server.post('/seed_session', nativeSeed('s1', 'r1'), { key: 'r9' });
    expect(reply.status).toBe(422);
    expect(String((reply.body.error as { detail: string }).detail)).toMatch(
      /does not match the rollout prefix/,
    );
  });

  test('close is idempotent, frees the state, and a closed id cannot be seeded again', async () => {
    const probe = probeServer();
    await using server = await startServer(probe, { checkpoint: false });
    await server.post('/seed_session', nativeSeed('s1', 'r1'), { key: 'r1' });
    const close = { resources_session_id: 's1', episode_id: episodeJson('r1') };
    const first = await server.post('/close_session', close, { key: 'r1' });
    const again = await server.post('/close_session', close, { key: 'r1' });
    expect([first.status, again.status]).toEqual([200, 200]);
    expect(first.body).toEqual({ resources_session_id: 's1' });
    expect(probe.values.has('s1')).toBe(false);
    const reseed = await server.post('/seed_session', nativeSeed('s1', 'r1'), { key: 'r1' });
    expect(reseed.status).toBe(422);
    expect(String((reseed.body.error as { detail: string }).detail)).toMatch(/closed/);
  });

  test('closing a session that was never seeded succeeds', async () => {
    await using server = await startServer(probeServer(), { checkpoint: false });
    const reply = await server.post(
      '/close_session',
      { resources_session_id: 'never', episode_id: episodeJson('r1') },
      { key: 'r1' },
    );
    expect(reply.status).toBe(200);
  });

  test('a native close by another episode is refused with stale_attempt', async () => {
    await using server = await startServer(probeServer(), { checkpoint: false });
    await server.post('/seed_session', nativeSeed('s1', 'r1'), { key: 'r1' });
    const reply = await server.post(
      '/close_session',
      { resources_session_id: 's1', episode_id: episodeJson('r2') },
      { key: 'r2' },
    );
    expect(reply.status).toBe(409);
    expect(reply.body.error).toMatchObject({ code: 'stale_attempt' });
  });

  test('a legacy seed body is free-form and its session comes from the cookie it sets', async () => {
    await using server = await startServer(counterServer(), { checkpoint: false });
    const cookie = await server.seed('r1', { initial_count: 2 });
    await server.post('/increment_counter', { count: 3 }, { cookie });
    expect((await server.post('/get_counter_value', {}, { cookie })).body).toEqual({ count: 5 });
  });

  test('a cookie with a bad signature is not accepted: the request gets a fresh session', async () => {
    await using server = await startServer(counterServer(), {
      checkpoint: false,
      sessionSecret: 'a',
    });
    const cookie = await server.seed('r1', { initial_count: 7 });
    const forged = new SessionCookie('res', Buffer.from('b'));
    const id = new SessionCookie('res', Buffer.from('a')).read(cookie);
    expect(id).toBeDefined();
    const reply = await server.post(
      '/get_counter_value',
      {},
      {
        cookie: `${forged.name}=${forged.sign(id as string)}`,
      },
    );
    expect(reply.body).toEqual({ count: 0 });
    expect(reply.setCookie).toBeDefined();
  });

  test('every route also answers under the rollout prefix', async () => {
    await using server = await startServer(weatherServer(), { checkpoint: false });
    const reply = await server.post('/get_weather', { city: 'SF' }, { key: 'r1-a2' });
    expect(reply.body).toEqual({ city: 'SF', forecast: 'sunny' });
  });

  test('verify replies with the request and its reward', async () => {
    await using server = await startServer(weatherServer(), { checkpoint: false });
    const body = { response: responseCalling('get_weather'), city: 'SF' };
    const reply = await server.post('/verify', body, { key: 'r1' });
    expect(reply.body).toEqual({ ...body, reward: 1 });
  });

  test('verify reads the task data from verification_input when the body carries it', async () => {
    await using server = await startServer(exactMatchServer(), { checkpoint: false });
    const body = {
      episode_id: episodeJson('r1'),
      task_id: { taskset: 'ts', task_id: 't' },
      verification_input: { expected_answer: 'Paris' },
      response: 'paris',
    };
    const reply = await server.post('/verify', body, { key: 'r1' });
    expect(reply.body).toEqual({ ...body, reward: 1 });
  });

  test('aggregate_metrics averages the rewards by default', async () => {
    await using server = await startServer(weatherServer(), { checkpoint: false });
    const reply = await server.post('/aggregate_metrics', {
      verify_responses: [{ reward: 1 }, { reward: 0 }],
    });
    expect(reply.body).toEqual({ count: 2, mean_reward: 0.5 });
  });

  test('aggregate_metrics reads its body with the wire contract: verify_responses null is refused, as the environment server refuses it', async () => {
    await using server = await startServer(weatherServer(), { checkpoint: false });
    const reply = await server.post('/aggregate_metrics', { verify_responses: null });
    expect(reply.status).toBe(422);
    expect(reply.body).toMatchObject({
      error: { code: 'invalid_request', detail: 'verify_responses: must be a list of objects' },
    });
    expect((await server.post('/aggregate_metrics', {})).body).toEqual({
      count: 0,
      mean_reward: 0,
    });
  });

  test('with checkpointing off there are no control routes and no checkpoint headers', async () => {
    await using server = await startServer(weatherServer(), { checkpoint: false });
    const seed = await server.post('/seed_session', {}, { key: 'r1' });
    expect(seed.headers.get('x-ng-checkpoint-verify')).toBeNull();
    expect(seed.headers.get('x-ng-checkpoint-restart')).toBeNull();
    expect((await server.control('status')).status).toBe(404);
    expect((await server.post('/seed_session', {})).status).toBe(200);
  });

  test('a body that is not a JSON object is refused with invalid_request', async () => {
    await using server = await startServer(weatherServer(), { checkpoint: false });
    const reply = await server.post('/get_weather', [1, 2]);
    expect(reply.status).toBe(422);
    expect(reply.body.error).toMatchObject({ code: 'invalid_request' });
  });

  test('a body in another charset, with a broken content encoding or nested 10k levels deep is 422 invalid_request', async () => {
    await using server = await startServer(counterServer(), { checkpoint: false });
    const body = JSON.stringify({ responses_create_params: { input: [] }, response: {} });
    const cases: [Record<string, string>, string | Uint8Array, string][] = [
      [{ 'content-type': 'application/json; charset=latin1' }, body, 'charset must be utf-8'],
      [{ 'content-encoding': 'gzip' }, gzipSync(body).subarray(0, 12), 'could not be decompressed'],
      [{}, '['.repeat(10_000) + ']'.repeat(10_000), 'nests deeper than'],
      [{}, Buffer.from([0x7b, 0x22, 0xff, 0x22, 0x3a, 0x31, 0x7d]), 'not valid UTF-8'],
    ];
    for (const [headers, sent, detail] of cases) {
      const res = await fetch(`${server.url}/verify`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', ...headers },
        body: sent,
      });
      expect([headers, res.status, await res.json()]).toEqual([
        headers,
        422,
        { error: { code: 'invalid_request', detail: expect.stringContaining(detail) } },
      ]);
    }
  });
});
