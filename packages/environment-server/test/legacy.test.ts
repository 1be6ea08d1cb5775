import { InvalidRolloutIdError, RolloutIdRequiredError } from '@ckpt-gym/core/protocol';
import { AGENT_RESPONSE, Gate, OBSERVATIONS } from '@ckpt-gym/testing';

import { episodeRequestFromRow } from '../src/legacy.js';
import { Harness } from './support/harness.js';

const ROW = {
  responses_create_params: { input: 'weather in Paris?' },
  agent_ref: { name: 'simple_agent' },
  expected_city: 'Paris',
  _ng_task_index: 4,
  _ng_rollout_index: 2,
};

describe('flat rows', () => {
  it('name the rollout "<task index>-<rollout index>" at the stamped attempt index', () => {
    const request = episodeRequestFromRow({ ...ROW, _ng_attempt_index: 3 }, 'weather');
    expect(request.episode_id).toEqual({ rollout_id: '4-2', attempt: 3 });
    expect(request.task).toEqual({
      task_id: { taskset: 'weather', task_id: '4' },
      task_input: {
        responses_create_params: { input: 'weather in Paris?' },
        task_data: { expected_city: 'Paris' },
      },
    });
  });

  it('take an explicit _ng_rollout_id over the indices', () => {
    const request = episodeRequestFromRow({ ...ROW, _ng_rollout_id: 'roll.1' }, 'weather');
    expect(request.episode_id).toEqual({ rollout_id: 'roll.1', attempt: 0 });
  });

  it('run an explicit "<id>-aN" as attempt N of <id>', () => {
    const request = episodeRequestFromRow({ ...ROW, _ng_rollout_id: 'restored-a1' }, 'weather');
    expect(request.episode_id).toEqual({ rollout_id: 'restored', attempt: 1 });
  });

  it('refuse an explicit "<id>-aN" together with an attempt index', () => {
    expect(() =>
      episodeRequestFromRow({ ...ROW, _ng_rollout_id: 'x-a1', _ng_attempt_index: 2 }, 'weather'),
    ).toThrow(InvalidRolloutIdError);
  });

  it.each([[{ toString: null }], [[{ valueOf: 1 }]], [true], [{ a: 1 }]])(
    'refuse a row whose rollout index is %j with invalid_rollout_id',
    (index) => {
      expect(() => episodeRequestFromRow({ ...ROW, _ng_rollout_index: index }, 'weather')).toThrow(
        InvalidRolloutIdError,
      );
    },
  );

  it('refuse a row that names no rollout', () => {
    const { _ng_rollout_index: _r, ...row } = ROW;
    expect(() => episodeRequestFromRow(row, 'weather')).toThrow(RolloutIdRequiredError);
  });

  it('name the task by task_id, problem_id or instance_id first, and the taskset by task_source', () => {
    const request = episodeRequestFromRow(
      { ...ROW, problem_id: 'p7', instance_id: 'i9', task_source: 'bench' },
      'weather',
    );
    expect(request.task.task_id).toEqual({ taskset: 'bench', task_id: 'p7' });
    expect(request.task.task_input.task_data).toEqual({
      expected_city: 'Paris',
      problem_id: 'p7',
      instance_id: 'i9',
    });
  });
});

describe('single_agent_turn_legacy', () => {
  it('runs an explicit "restored-a1" row as attempt 1 under the prefix restored-a1 and replies a flat row', async () => {
    await using h = await new Harness({ legacy: true }).start();
    const reply = await h.run({ ...ROW, _ng_rollout_id: 'restored-a1' });
    expect(reply.status).toBe(200);
    expect(reply.body).toEqual({
      reward: 1,
      response: AGENT_RESPONSE,
      ng_agent_observations: OBSERVATIONS,
    });
    const seed = h.resources.calls[0]!;
    expect(seed.body.episode_id).toEqual({ rollout_id: 'restored', attempt: 1 });
    const activation = h.agent.calls.find((c) => c.path === '/v1/responses')!;
    expect(activation.key).toBe('restored-a1');
    expect(activation.body).toEqual({ input: 'weather in Paris?' });
  });

  it('checkpoints its rows like native episodes', async () => {
    await using h = await new Harness({ legacy: true }).start();
    const activation = new Gate();
    h.agent.on('/v1/responses', { gate: activation });
    const run = h.run(ROW);
    await h.agent.arrived('/v1/responses');
    expect((await h.prepare('c1')).body.phase).toBe('prepared');
    expect((await h.commit('c1', null)).body.episode_ids).toEqual(['4-2']);
    const [record] = await h.records('c1');
    expect(record!.boundary).toMatchObject({ next: 'invoke_agent' });
    await h.resume('c1');
    activation.open();
    expect((await run).body).toMatchObject({ reward: 1 });
  });

  it('keeps the native reply for a failed episode', async () => {
    await using h = await new Harness({ legacy: true }).start();
    h.resources.on('/seed_session', { status: 400 });
    const reply = await h.run(ROW);
    expect(reply.body).toMatchObject({
      episode_id: { rollout_id: '4-2', attempt: 0 },
      result: null,
      failure: { stage: 'seed', terminal: true },
    });
  });
});
