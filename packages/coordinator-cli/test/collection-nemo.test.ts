/**
 * NeMo Gym rows in and out: the indices stamped as `ng_collect_rollouts` stamps them, the native
 * task a row stands for, and the output row (flat reply, or the failures sidecar).
 */
import { detectFormat, inputTasks, parseJsonLines } from '../src/collect.js';
import {
  failuresPathFor,
  flatRowFromTask,
  nemoNativeTask,
  nemoOutputRow,
  nemoTasks,
} from '../src/collection/nemo.js';

const weather = {
  responses_create_params: { input: [{ role: 'user', content: 'weather in SF?' }] },
  agent_ref: { name: 'weather_agent' },
  expected_city: 'San Francisco',
};
const other = { responses_create_params: { input: 'other' } };

test('task and rollout indices: one task per distinct row, repeats numbered within a task', () => {
  const tasks = nemoTasks([weather, other, weather], { numRepeats: 2 });
  expect(tasks.map((t) => t.key)).toEqual(['0-0', '0-1', '1-0', '1-1', '0-2', '0-3']);
  expect(tasks[2]!.row).toEqual({ ...other, _ng_task_index: 1, _ng_rollout_index: 0 });
});

test('a given _ng_task_index is kept, --limit takes the first rows', () => {
  const tasks = nemoTasks([{ ...other, _ng_task_index: 7 }, weather, other], { limit: 2 });
  expect(tasks.map((t) => t.key)).toEqual(['7-0', '0-0']);
  expect(() => nemoTasks([{ agent_ref: {} }])).toThrow(/row 1: responses_create_params/);
});

test('a NeMo Gym row is detected and becomes the native task the legacy environment makes of it', () => {
  const text = `${JSON.stringify(weather)}\n\n${JSON.stringify(other)}\n`;
  expect(detectFormat(parseJsonLines(text))).toBe('nemo');
  const { format, tasks } = inputTasks(text, { numRepeats: 1 });
  expect([format, tasks.map((t) => t.key)]).toEqual(['nemo', ['0-0', '1-0']]);
  expect(tasks[0]!.task).toEqual({
    task_id: { taskset: 'weather_agent', task_id: '0' },
    task_input: {
      responses_create_params: weather.responses_create_params,
      task_data: { expected_city: 'San Francisco' },
    },
  });
  expect(nemoNativeTask(tasks[1]!.row!).task_id.taskset).toBe('nemo_gym');
});

test('our rows are not NeMo Gym rows; --num-repeats needs NeMo Gym rows', () => {
  const ours = JSON.stringify({
    task_id: { taskset: 't', task_id: '1' },
    task_input: { responses_create_params: {}, task_data: {} },
  });
  expect(inputTasks(ours, {}).format).toBe('ckpt-gym');
  expect(() => inputTasks(ours, { numRepeats: 2 })).toThrow(/--num-repeats takes NeMo Gym rows/);
});

test('our task as a flat row keeps its task id and data for the legacy environment', () => {
  const row = flatRowFromTask({
    task_id: { taskset: 'counter', task_id: '3' },
    task_input: { responses_create_params: { input: 'x' }, task_data: { initial_count: 3 } },
  });
  expect(row).toEqual({
    initial_count: 3,
    responses_create_params: { input: 'x' },
    task_id: '3',
    task_source: 'counter',
  });
});

const [task] = nemoTasks([weather]);
const ids = { runId: 'run-a', rolloutId: 'run-a.0-0', attempt: 0 };

test('a reply is the flat row with the indices, the agent_ref and the identity', () => {
  const result = { reward: 1, response: { output: [] }, expected_city: 'San Francisco' };
  const out = nemoOutputRow(task!, ids, { result, failure: null, captureFailures: [] });
  expect(out).toEqual({
    failed: false,
    row: {
      ...result,
      _ng_task_index: 0,
      _ng_rollout_index: 0,
      agent_ref: { name: 'weather_agent' },
      _ng_rollout_id: 'run-a.0-0',
      _ng_run_id: 'run-a',
    },
  });
  const later = nemoOutputRow(
    task!,
    { ...ids, attempt: 2 },
    { result, failure: null, captureFailures: [] },
  );
  expect(later.row._ng_attempt_index).toBe(2);
});

test('a failed episode, a stamped failure class and a failed capture go to the sidecar', () => {
  const failure = { failure_reason: 'agent failed', stage: 'agent', terminal: false };
  const failed = nemoOutputRow(task!, ids, { result: null, failure, captureFailures: [] });
  expect(failed.failed).toBe(true);
  expect(failed.row).toMatchObject({
    _ng_failure_class: 'environment_server_failed',
    _ng_failure_stage: 'agent',
    _ng_failure_reason: 'agent failed',
    _ng_task_index: 0,
  });
  const stamped = nemoOutputRow(task!, ids, {
    result: { reward: 0, _ng_failure_class: 'judge_failed' },
    failure: null,
    captureFailures: [],
  });
  expect([stamped.failed, stamped.row._ng_failure_class]).toEqual([true, 'judge_failed']);
  const capture = nemoOutputRow(task!, ids, {
    result: { reward: 1 },
    failure: null,
    captureFailures: ['call-2: worker_capture_failed'],
  });
  expect([capture.failed, capture.row._ng_failure_class]).toEqual([true, 'capture_failed']);
});

test('the sidecar is <stem>_failures.jsonl beside the output', () => {
  expect(failuresPathFor('/out/rollouts.jsonl')).toBe('/out/rollouts_failures.jsonl');
  expect(failuresPathFor('/out/rollouts')).toBe('/out/rollouts_failures.jsonl');
});
