import { readFile, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';

import { parseStackFile } from '@ckpt-gym/core/server';
import { until } from '@ckpt-gym/testing';

import {
  chosenOption,
  counterServer,
  definitionFor,
  exactMatchServer,
  lastNumber,
  multipleChoiceServer,
  numericMatchServer,
  slowVerifyServer,
  weatherRestartServer,
  weatherServer,
} from '../src/index.js';
import {
  cleanUp,
  episodeJson,
  responseCalling,
  responseSaying,
  startServer,
  tempDir,
  track,
} from './support.js';

afterEach(cleanUp);

describe('counter', () => {
  test('increments, reads and verifies against expected_count', async () => {
    const server = await startServer(counterServer());
    const cookie = await server.seed('r1', { initial_count: 1 });
    expect(
      (await server.post('/increment_counter', { count: 2 }, { cookie, key: 'r1' })).body,
    ).toEqual({ success: true });
    expect((await server.post('/get_counter_value', {}, { cookie, key: 'r1' })).body).toEqual({
      count: 3,
    });
    const wrong = await server.post('/verify', { expected_count: 4 }, { cookie, key: 'r1' });
    expect(wrong.body).toMatchObject({ reward: 0, count: 3 });
  });

  test("verify reads expected_count from the native seed's task data when the body has none", async () => {
    const server = await startServer(counterServer());
    const seed = await server.post(
      '/seed_session',
      {
        resources_session_id: 's1',
        episode_id: episodeJson('r1'),
        task_id: { taskset: 'ts', task_id: 't' },
        task_data: { initial_count: 2, expected_count: 2 },
      },
      { key: 'r1' },
    );
    const verified = await server.post(
      '/verify',
      { response: 'done' },
      { cookie: seed.setCookie, key: 'r1' },
    );
    expect(verified.body.reward).toBe(1);
  });

  test('the counter leaves a session it no longer holds out of its export', async () => {
    const counter = counterServer();
    const hooks = counter.hooks as Required<NonNullable<typeof counter.hooks>>;
    const server = await startServer(counter);
    const cookie = await server.seed('r1', { initial_count: 5 });
    await server.seed('r2');
    await server.post('/close_session', {}, { cookie, key: 'r1' });
    expect(
      Object.values(await hooks.exportSessionStates([...counter.counters.keys(), 'gone'])),
    ).toEqual([{ count: 0 }]);
  });

  test('the counter validates every restored state before installing any', async () => {
    const counter = counterServer();
    const hooks = counter.hooks as Required<NonNullable<typeof counter.hooks>>;
    await expect(
      hooks.restoreSessionStates({ a: { count: 1 }, b: { count: 'x' } }),
    ).rejects.toThrow(/invalid counter state for session b/);
    expect(counter.counters.size).toBe(0);
    await hooks.restoreSessionStates({ a: { count: 1 } });
    expect(counter.counters.get('a')).toBe(1);
  });
});

describe('weather', () => {
  test('get_weather returns the forecast and the reward is 1.0 only when the agent called it', async () => {
    const server = await startServer(weatherServer());
    const cookie = await server.seed('r1');
    expect((await server.post('/get_weather', { city: 'SF' }, { cookie, key: 'r1' })).body).toEqual(
      {
        city: 'SF',
        forecast: 'sunny',
      },
    );
    const called = await server.post(
      '/verify',
      { response: responseCalling('get_weather') },
      { cookie, key: 'r1' },
    );
    const notCalled = await server.post(
      '/verify',
      { response: responseSaying('sunny') },
      { cookie, key: 'r1' },
    );
    expect([called.body.reward, notCalled.body.reward]).toEqual([1, 0]);
  });

  test('weather is stateless and weather_restart is restart_only', async () => {
    const stateless = await startServer(weatherServer(), { name: 'w1' });
    const restart = await startServer(weatherRestartServer(), { name: 'w2' });
    const a = await stateless.post('/seed_session', {}, { key: 'r1' });
    const b = await restart.post('/seed_session', {}, { key: 'r1' });
    expect(a.headers.get('x-ng-checkpoint-restart')).toBeNull();
    expect(b.headers.get('x-ng-checkpoint-restart')).toBe('1');
    expect((await stateless.control('status')).body.mode).toBe('stateless');
    expect((await restart.control('status')).body.mode).toBe('restart_only');
  });
});

describe('slow_verify', () => {
  test('verify blocks while the flag file exists and logs each verification', async () => {
    const dir = await tempDir();
    const flagFile = join(dir, 'flag');
    const verifyLog = join(dir, 'verify.log');
    await writeFile(flagFile, '');
    const server = await startServer(slowVerifyServer({ flagFile, verifyLog }));
    const cookie = await server.seed('r1');
    const verify = track(
      server.post('/verify', { response: responseCalling('get_weather') }, { cookie, key: 'r1' }),
    );
    await until(() => server.participant.readiness().counts.inflight === 1, 'verify in flight');
    expect(verify.done).toBe(false);
    expect(
      // A deadline just ahead: the reply comes almost at once, with the report.
      (
        await server.control('prepare', {
          checkpoint_id: 'c1',
          deadline_ts: Date.now() / 1000 + 0.05,
        })
      ).body.phase,
    ).toBe('preparing');
    await rm(flagFile);
    expect((await verify.promise).body.reward).toBe(1);
    const lines = (await readFile(verifyLog, 'utf8'))
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l));
    expect(lines).toEqual([{ session_id: expect.any(String), episode: 'r1', reward: 1 }]);
  });

  test('its verify mode comes from config and is checked at startup', async () => {
    const dir = await tempDir();
    const stack = parseStackFile(
      [
        'servers:',
        '  slow: { kind: resources, app: slow_verify, port: 0, flag_file: flag, verify_log: v.log, checkpoint_verify: replay }',
        '  typo: { kind: resources, app: slow_verify, port: 0, flag_file: flag, verify_log: v.log, checkpoint_verify: replayy }',
        '  nolog: { kind: resources, app: slow_verify, port: 0, flag_file: flag }',
      ].join('\n'),
      { source: join(dir, 'stack.yaml') },
    );
    const slow = definitionFor(stack.servers.get('slow')!, dir);
    expect(slow.checkpointVerify).toBe('replay');
    const server = await startServer(slow);
    expect(
      (await server.post('/seed_session', {}, { key: 'r1' })).headers.get('x-ng-checkpoint-verify'),
    ).toBe('replay');
    await expect(startServer(definitionFor(stack.servers.get('typo')!, dir))).rejects.toThrow(
      /checkpoint_verify "replayy"/,
    );
    expect(() => definitionFor(stack.servers.get('nolog')!, dir)).toThrow(/verify_log: required/);
  });
});

describe('registry', () => {
  test('every app name maps to its definition and an unknown one is refused', () => {
    const stack = parseStackFile(
      [
        'servers:',
        ...[
          'counter',
          'weather',
          'weather_restart',
          'exact_match',
          'multiple_choice',
          'numeric_match',
        ].map((app, i) => `  s${i}: { kind: resources, app: ${app}, port: ${9000 + i} }`),
        '  bad: { kind: resources, app: nope, port: 9100 }',
      ].join('\n'),
    );
    for (const [name, server] of stack.servers) {
      if (name === 'bad')
        expect(() => definitionFor(server, '/')).toThrow(/'nope' is not a resources app/);
      else expect(definitionFor(server, '/').app).toBe(server.app);
    }
  });
});

describe('verifiers', () => {
  test.each([
    ['exact_match', '  Paris ', 'paris', 1],
    ['exact_match', 'Paris, France', 'Paris', 0],
    ['multiple_choice', 'I think the answer is (C).', 'C', 1],
    ['multiple_choice', 'Answer: B', 'C', 0],
    ['numeric_match', 'so the total is 1,234.5', '1234.5', 1],
    ['numeric_match', 'x = 3', 4, 0],
  ] as const)('%s scores %j against %j as %d', async (app, text, expected, reward) => {
    const factory = {
      exact_match: exactMatchServer,
      multiple_choice: multipleChoiceServer,
      numeric_match: numericMatchServer,
    }[app];
    const server = await startServer(factory());
    const cookie = await server.seed('r1');
    const reply = await server.post(
      '/verify',
      { response: responseSaying(text), expected_answer: expected },
      { cookie, key: 'r1' },
    );
    expect(reply.body.reward).toBe(reward);
  });

  test('answer extraction', () => {
    expect(chosenOption('A or B? I pick D')).toBe('D');
    expect(lastNumber('between -2 and 3e2')).toBe(300);
    expect(lastNumber('none')).toBeUndefined();
  });
});
