import {
  isNativeBody,
  type NativeCloseRequest,
  type NativeSeedRequest,
  parseNativeCloseRequest,
  parseNativeSeedRequest,
  MAX_SESSION_ID_CHARS,
} from '../../src/wire/index.js';
import { refusal } from './support.js';

/** A native seed as the environment server builds it. */
const SEED: NativeSeedRequest = {
  resources_session_id: 'resources-session-1',
  episode_id: { rollout_id: 'r1', attempt: 1 },
  task_id: { taskset: 'weather', task_id: 't1' },
  task_data: { expected_city: 'SF' },
};

const CLOSE: NativeCloseRequest = {
  resources_session_id: 'resources-session-1',
  episode_id: { rollout_id: 'r1', attempt: 1 },
};

describe('the native resources seed contract', () => {
  test('a seed the sender built passes unchanged, and is native', () => {
    expect(parseNativeSeedRequest(structuredClone(SEED))).toEqual(SEED);
    expect(isNativeBody(JSON.parse(JSON.stringify(SEED)))).toBe(true);
    expect(isNativeBody({ initial_count: 1 })).toBe(false);
  });

  test('null task_data reads as absent task data', () => {
    expect(parseNativeSeedRequest({ ...SEED, task_data: null })).toEqual({
      ...SEED,
      task_data: {},
    });
  });

  test('task_data defaults to an empty object, the attempt to 0', () => {
    const { task_data: _data, ...rest } = SEED;
    expect(parseNativeSeedRequest({ ...rest, episode_id: { rollout_id: 'r1' } })).toEqual({
      ...rest,
      episode_id: { rollout_id: 'r1', attempt: 0 },
      task_data: {},
    });
  });

  test.each([
    ['resources_session_id', 'seed_session.resources_session_id: must be a non-empty string'],
    ['episode_id', 'seed_session.episode_id: must be an object'],
    ['task_id', 'seed_session.task_id: must be {"taskset": string, "task_id": string}'],
  ])('a seed without %s is refused naming it', (field, detail) => {
    const { [field as keyof NativeSeedRequest]: _gone, ...rest } = SEED;
    expect(refusal(() => parseNativeSeedRequest(rest))).toContain(detail);
  });

  test.each([
    ['a body that is no object', null, 'seed_session: must be a JSON object'],
    ['an unknown field', { ...SEED, extra: 1 }, 'seed_session: unknown keys extra'],
    [
      'a session id that is a number',
      { ...SEED, resources_session_id: 1 },
      'seed_session.resources_session_id:',
    ],
    [
      'a session id too long for its cookie',
      { ...SEED, resources_session_id: 's'.repeat(MAX_SESSION_ID_CHARS + 1) },
      'seed_session.resources_session_id:',
    ],
    [
      'a lone surrogate in the session id',
      { ...SEED, resources_session_id: 'a\udc00' },
      'seed_session.resources_session_id:',
    ],
    [
      'an episode attempt that is negative',
      { ...SEED, episode_id: { rollout_id: 'r1', attempt: -1 } },
      'seed_session.episode_id: attempt',
    ],
    ['a task_id that is a string', { ...SEED, task_id: 't1' }, 'seed_session.task_id:'],
    [
      'a task_id with a third field',
      { ...SEED, task_id: { ...SEED.task_id, x: 1 } },
      'seed_session.task_id: unknown keys x',
    ],
    [
      'a taskset that is no string',
      { ...SEED, task_id: { taskset: 1, task_id: 't' } },
      'seed_session.task_id.taskset:',
    ],
    [
      'task_data that is a list',
      { ...SEED, task_data: [] },
      'seed_session.task_data: must be an object',
    ],
  ])('%s is 422 invalid_request naming the field', (_what, body, detail) => {
    expect(refusal(() => parseNativeSeedRequest(body))).toContain(detail);
  });
});

describe('the native resources close contract', () => {
  test('a close the sender built passes unchanged', () => {
    expect(parseNativeCloseRequest(structuredClone(CLOSE))).toEqual(CLOSE);
  });

  test.each([
    [
      'without resources_session_id',
      { episode_id: CLOSE.episode_id },
      'close_session.resources_session_id:',
    ],
    ['without episode_id', { resources_session_id: 's' }, 'close_session.episode_id:'],
    ['with task fields', { ...CLOSE, task_data: {} }, 'close_session: unknown keys task_data'],
    [
      'with an episode that is a list',
      { ...CLOSE, episode_id: [] },
      'close_session.episode_id: must be an object',
    ],
  ])('a close %s is 422 invalid_request naming the field', (_what, body, detail) => {
    expect(refusal(() => parseNativeCloseRequest(body))).toContain(detail);
  });
});
