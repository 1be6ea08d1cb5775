import { MAX_SESSION_ID_CHARS as MAX_AGENT_SESSION_ID_CHARS } from '@ckpt-gym/core/protocol';

import {
  activate,
  closeSession,
  errorCode,
  post,
  seed,
  startStack,
  weatherAccess,
} from './support/harness.js';

describe('agent sessions', () => {
  test('a seeded session runs the turn loop: model call, tool call under the prefix, final answer', async () => {
    await using h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    expect(s.reply.status).toBe(200);
    expect(s.reply.body).toEqual({ agent_session_id: 'sess-1' });
    const reply = await activate(h, s, 'r1');
    expect(reply.status).toBe(200);
    const output = reply.body.output as { type: string; output?: string }[];
    expect(output.map((o) => o.type)).toEqual(['function_call', 'function_call_output', 'message']);
    expect(JSON.parse(output[1]!.output!)).toEqual({ city: 'SF', weather: 'sunny' });
    expect(h.model.calls.map((c) => c.key)).toEqual(['r1', 'r1']);
    expect(h.resources.calls).toEqual([
      expect.objectContaining({
        key: 'r1',
        path: '/get_weather',
        body: { city: 'SF' },
        cookie: 'res_session=seeded',
      }),
    ]);
    expect(reply.body.usage).toEqual(expect.objectContaining({ total_tokens: 10 }));
  });

  test('a seed is idempotent per id, and a different seed with the same id is refused', async () => {
    await using h = await startStack();
    const first = await seed(h, 'sess-1', 'r1');
    const again = await seed(h, 'sess-1', 'r1');
    expect(again.reply.status).toBe(200);
    expect(h.agent.sessions.size).toBe(1);
    const other = await seed(h, 'sess-1', 'r2');
    expect(other.reply.status).toBe(409);
    expect(first.cookie).toBe(again.cookie);
  });

  test('a cookie with a bad signature is refused', async () => {
    await using h = await startStack();
    await seed(h, 'sess-1', 'r1');
    const reply = await activate(
      h,
      { id: 'sess-1', cookie: 'agent_session_id=sess-1.forged' },
      'r1',
    );
    expect(reply.status).toBe(409);
    expect((reply.body.error as { detail: string }).detail).toBe('Invalid agent session marker');
  });

  test('close returns the observations and the cookie jar, and a retried close gets the same receipt', async () => {
    await using h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    await activate(h, s, 'r1');
    const closed = await closeSession(h, s, { rollout_id: 'r1', attempt: 0 });
    expect(closed.status).toBe(200);
    expect(closed.body.resources_cookies).toEqual({ res_session: 'r1' });
    const observations = closed.body.agent_observations as {
      invocations: { invocation_id: string }[];
    };
    expect(observations.invocations.map((i) => i.invocation_id)).toEqual(['root']);
    const retried = await closeSession(h, s);
    expect(retried.body).toEqual(closed.body);
    expect(h.agent.sessions.size).toBe(0);
    // A closed session is gone: a later seed of the same id is refused while the receipt lives.
    expect((await seed(h, 'sess-1', 'r1')).reply.status).toBe(409);
  });

  test('closing an unknown id writes a receipt that blocks a racing seed', async () => {
    await using h = await startStack();
    const closed = await closeSession(h, { id: 'late', cookie: '' });
    expect(closed.body).toEqual({
      agent_session_id: 'late',
      agent_observations: null,
      resources_cookies: null,
    });
    expect((await seed(h, 'late', 'r1')).reply.status).toBe(409);
  });

  test('a session without a direct tool grant keeps no resources cookie jar', async () => {
    await using h = await startStack({ checkpoint: false });
    const s = await seed(h, 'sess-1', 'r1', { tools: [] });
    const closed = await closeSession(h, s);
    expect(closed.body.resources_cookies).toBeNull();
  });

  test('each activation gets its own invocation id: root, then activation-2', async () => {
    await using h = await startStack({ checkpoint: false });
    const s = await seed(h, 'sess-1', 'r1');
    await activate(h, s, null);
    await activate(h, s, null);
    const closed = await closeSession(h, s);
    const ids = (
      closed.body.agent_observations as { invocations: { invocation_id: string }[] }
    ).invocations.map((i) => i.invocation_id);
    expect(ids).toEqual(['root', 'activation-2']);
  });

  test('with checkpointing off, an activation without the rollout prefix is accepted', async () => {
    await using h = await startStack({ checkpoint: false });
    const s = await seed(h, 'sess-1', 'r1');
    const reply = await activate(h, s, null);
    expect(reply.status).toBe(200);
    expect(h.model.calls[0]!.key).toBeNull();
  });

  test('an unknown session is refused', async () => {
    await using h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    await closeSession(h, s);
    const reply = await activate(h, s, 'r1');
    expect(reply.status).toBe(409);
    expect(errorCode(reply)).toBe('checkpoint_error');
  });

  test('a seed body with unknown fields is 422 invalid_request', async () => {
    await using h = await startStack();
    const reply = await post(`${h.url}/v1/agent_sessions`, {
      agent_session_id: 'x',
      episode_id: { rollout_id: 'r1', attempt: 0 },
      task_id: 't',
      tool_accesses: [],
      sandbox_access: null,
      surprise: 1,
    });
    expect(reply.status).toBe(422);
  });

  test.each([
    ['a lone surrogate', '\ud800'],
    ['too long for its cookie', 'x'.repeat(MAX_AGENT_SESSION_ID_CHARS + 1)],
    ['empty', ''],
  ])('an agent_session_id that is %s is 422 before any session exists', async (_what, id) => {
    await using h = await startStack();
    const reply = await post(`${h.url}/ng-rollout/r1/v1/agent_sessions`, {
      agent_session_id: id,
      episode_id: { rollout_id: 'r1', attempt: 0 },
      task_id: 't',
      tool_accesses: [],
      sandbox_access: null,
    });
    expect([reply.status, errorCode(reply)]).toEqual([422, 'invalid_request']);
    expect(h.agent.sessions.size).toBe(0);
    const close = await post(`${h.url}/v1/agent_sessions/close`, { agent_session_id: id });
    expect([close.status, errorCode(close)]).toEqual([422, 'invalid_request']);
  });

  test.each([
    ['a cookie value with a character no header can carry', { cookies: { s: 'caf\u20ac' } }],
    ['a cookie value with a semicolon', { cookies: { s: 'a; b=c' } }],
    ['a header name that is no token', { headers: { 'x y': '1' } }],
    ['a header value with a newline', { headers: { 'x-a': 'a\nb' } }],
    ['a base_url that is no URL', { base_url: 'http://a b' }],
  ])('a tool grant with %s is 422 at the seed', async (_what, change) => {
    await using h = await startStack();
    const s = await seed(h, 'sess-1', 'r1', {
      tools: [{ ...weatherAccess(h.resources.url, 'r1'), ...change }],
    });
    expect([s.reply.status, errorCode(s.reply)]).toEqual([422, 'invalid_request']);
    expect(h.agent.sessions.size).toBe(0);
  });

  test('an activation whose model calls a tool the session has no grant for is 422', async () => {
    await using h = await startStack();
    const s = await seed(h, 'sess-1', 'r1', { tools: [] });
    const reply = await activate(h, s, 'r1');
    expect([reply.status, errorCode(reply)]).toEqual([422, 'invalid_request']);
    expect(reply.body.error).toMatchObject({ detail: expect.stringContaining('get_weather') });
  });
});
