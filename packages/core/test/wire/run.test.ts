import {
  type AggregateMetricsRequest,
  type EpisodeRequest,
  parseAggregateMetricsRequest,
  parseEpisodeRequest,
  parseLegacyRunRow,
} from '../../src/wire/index.js';
import { refusal } from './support.js';

/** A `/run` body as a collector builds it. */
const RUN: EpisodeRequest = {
  episode_id: { rollout_id: 'r1', attempt: 0 },
  task: {
    task_id: { taskset: 'weather', task_id: 't1' },
    task_input: { responses_create_params: { input: 'hi' }, task_data: { expected_city: 'SF' } },
  },
};

describe('the /run contract', () => {
  test('a body the sender built passes unchanged; the attempt defaults to 0', () => {
    expect(parseEpisodeRequest(structuredClone(RUN))).toEqual(RUN);
    expect(parseEpisodeRequest({ ...RUN, episode_id: { rollout_id: 'r1' } })).toEqual(RUN);
  });

  test.each([
    ['episode_id', 'episode_id: must be an object'],
    ['task', 'task: must be an object'],
  ])('a body without %s is refused naming it', (field, detail) => {
    const { [field as keyof EpisodeRequest]: _gone, ...rest } = RUN;
    expect(refusal(() => parseEpisodeRequest(rest))).toContain(detail);
  });

  const task = RUN.task;
  test.each([
    ['a body that is no object', 'run', 'body: must be a JSON object'],
    ['an extra top-level key', { ...RUN, extra: 1 }, 'body: unknown keys extra'],
    ['an extra task key', { ...RUN, task: { ...task, more: 1 } }, 'task: unknown keys more'],
    ['a task that is a list', { ...RUN, task: [] }, 'task: must be an object'],
    ['a missing task_id', { ...RUN, task: { task_input: {} } }, 'task.task_id: must be an object'],
    [
      'a missing task_input',
      { ...RUN, task: { task_id: task.task_id } },
      'task.task_input: must be an object',
    ],
    [
      'a task_input that is a string',
      { ...RUN, task: { ...task, task_input: 'x' } },
      'task.task_input: must be an object',
    ],
    [
      'an empty taskset',
      { ...RUN, task: { ...task, task_id: { taskset: '', task_id: 't' } } },
      'task.task_id.taskset: must be a non-empty string',
    ],
    [
      'a missing task id',
      { ...RUN, task: { ...task, task_id: { taskset: 'a' } } },
      'task.task_id.task_id: must be a non-empty string',
    ],
    [
      'a task id with an extra key',
      { ...RUN, task: { ...task, task_id: { ...task.task_id, x: 1 } } },
      'task.task_id: unknown keys x',
    ],
    [
      'a reserved rollout id suffix',
      { ...RUN, episode_id: { rollout_id: 'r-a2' } },
      'episode_id: rollout_id "r-a2" must not end with the reserved attempt suffix',
    ],
  ])('%s is 422 invalid_request naming the field', (_what, body, detail) => {
    expect(refusal(() => parseEpisodeRequest(body))).toContain(detail);
  });
});

describe('the legacy /run row and /aggregate_metrics contracts', () => {
  test('a row is any JSON object; anything else is refused', () => {
    const row = { _ng_rollout_id: 'r1', responses_create_params: {}, expected_city: 'SF' };
    expect(parseLegacyRunRow(row)).toBe(row);
    expect(refusal(() => parseLegacyRunRow([row]))).toBe(
      'body: must be a JSON object (a flat row)',
    );
  });

  test('an aggregate body lists objects in verify_responses and keeps its other keys', () => {
    const body: AggregateMetricsRequest = { verify_responses: [{ reward: 1 }], extra: true };
    expect(parseAggregateMetricsRequest(body)).toBe(body);
    expect(parseAggregateMetricsRequest({})).toEqual({});
  });

  test.each([
    ['a body that is no object', 1, 'body: must be a JSON object'],
    [
      'verify_responses that are no list',
      { verify_responses: {} },
      'verify_responses: must be a list of objects',
    ],
    [
      'a verify response that is no object',
      { verify_responses: [{}, 2] },
      'verify_responses[1]: must be a list of objects',
    ],
  ])('%s is 422 invalid_request naming the field', (_what, body, detail) => {
    expect(refusal(() => parseAggregateMetricsRequest(body))).toContain(detail);
  });
});
