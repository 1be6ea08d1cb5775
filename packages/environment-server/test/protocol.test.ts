import { InvalidRequestError, parseEpisodeRequest } from '@ckpt-gym/core/protocol';
import { HTTPError, RequestError } from 'got';

import { canonicalPythonJson, taskDigest } from '../src/participant.js';
import {
  CleanupStack,
  EpisodeQueue,
  failureReply,
  isRetryableError,
  isRetryableStatus,
  MAX_FAILURE_REASON_CHARS,
  stageFailure,
} from '../src/protocol.js';
import { runBody } from './support/harness.js';

describe('the /run request', () => {
  it('parses a valid body with the default attempt', () => {
    const body = runBody('r1');
    const { episode_id: _e, ...rest } = body;
    const parsed = parseEpisodeRequest({ ...rest, episode_id: { rollout_id: 'r1' } });
    expect(parsed.episode_id).toEqual({ rollout_id: 'r1', attempt: 0 });
    expect(parsed.task.task_id).toEqual({ taskset: 'weather', task_id: 't1' });
  });

  it.each([
    ['an extra top-level key', { ...runBody('r'), extra: 1 }],
    ['an extra task key', { ...runBody('r'), task: { ...runBody('r').task, more: 1 } }],
    [
      'an empty taskset',
      { ...runBody('r'), task: { ...runBody('r').task, task_id: { taskset: '', task_id: 't' } } },
    ],
    ['a reserved rollout id suffix', runBody('r-a2')],
    [
      'a missing task_input',
      { episode_id: { rollout_id: 'r' }, task: { task_id: { taskset: 'a', task_id: 'b' } } },
    ],
  ])('refuses %s with invalid_request', (_what, body) => {
    expect(() => parseEpisodeRequest(body)).toThrow(InvalidRequestError);
  });
});

describe('failure classification', () => {
  it('treats 408, 425, 429 and 5xx as retryable and other statuses as terminal', () => {
    for (const s of [408, 425, 429, 500, 502, 503, 599]) expect(isRetryableStatus(s)).toBe(true);
    for (const s of [400, 401, 404, 409, 422]) expect(isRetryableStatus(s)).toBe(false);
  });

  it('treats connection errors as retryable and plain errors as terminal', () => {
    const refused = Object.assign(new Error('connect ECONNREFUSED'), { code: 'ECONNREFUSED' });
    expect(isRetryableError(refused)).toBe(true);
    expect(
      isRetryableError(new RequestError('reset', { code: 'ECONNRESET' } as never, {} as never)),
    ).toBe(true);
    expect(isRetryableError(new Error('bad reply'))).toBe(false);
  });

  it('reads the status of an HTTP error', () => {
    const http503 = Object.create(HTTPError.prototype) as Error & { response: unknown };
    Object.assign(http503, { name: 'HTTPError', message: 'x', response: { statusCode: 503 } });
    const http400 = Object.create(HTTPError.prototype) as Error & { response: unknown };
    Object.assign(http400, { name: 'HTTPError', message: 'x', response: { statusCode: 400 } });
    expect(stageFailure('seed', 'Seeding', http503).failure.terminal).toBe(false);
    expect(stageFailure('seed', 'Seeding', http400).failure.terminal).toBe(true);
    expect(stageFailure('seed', 'Seeding', http400).failure.stage).toBe('seed');
  });

  it('truncates the failure reason to 2000 characters and leaves unset fields out', () => {
    const reply = failureReply(parseEpisodeRequest(runBody('r')), {
      failure_reason: 'x'.repeat(5000),
      terminal: true,
      stage: undefined,
    });
    expect(reply.failure!.failure_reason).toHaveLength(MAX_FAILURE_REASON_CHARS);
    expect('stage' in reply.failure!).toBe(false);
    expect(reply.result).toBeNull();
  });
});

describe('queue admission', () => {
  it('admits up to the limit, times out a waiter, and hands a freed slot to the next waiter', async () => {
    const queue = new EpisodeQueue(1);
    const first = await queue.acquire(10);
    expect(first).not.toBeNull();
    expect(await queue.acquire(0.01)).toBeNull();
    expect(queue.waiting).toBe(0);
    const second = queue.acquire(10);
    first!();
    first!(); // a second release frees nothing more
    const release = await second;
    expect(release).not.toBeNull();
    expect(queue.active).toBe(1);
    release!();
    expect(queue.active).toBe(0);
  });
});

describe('the cleanup stack', () => {
  it('unwinds last-in first-out and skips entries already closed', async () => {
    const order: string[] = [];
    const stack = new CleanupStack(5);
    stack.push('resources', async () => void order.push('resources'));
    const agent = stack.push('agent', async () => void order.push('agent'));
    stack.push('post-verification', async () => void order.push('post'));
    await agent.close();
    await stack.unwind();
    expect(order).toEqual(['agent', 'post', 'resources']);
  });

  it('keeps going after a failure and retries a failed entry when closed again', async () => {
    const warnings: string[] = [];
    const stack = new CleanupStack(5, { warn: (m) => void warnings.push(m) });
    let tries = 0;
    const first = stack.push('flaky', async () => {
      tries += 1;
      if (tries === 1) throw new Error('boom');
    });
    stack.push('again', (signal) => first.close(signal));
    await stack.unwind();
    expect(tries).toBe(2);
    expect(first.active).toBe(false);
    expect(warnings).toEqual(['episode cleanup failed']);
  });
});

describe('the task digest', () => {
  // Computed with Python: json.dumps(task, sort_keys=True, separators=(",", ":")), then sha256.
  const task = {
    task_id: { taskset: 'weather', task_id: 't1' },
    task_input: {
      responses_create_params: {
        input: "Qu'il fait à Zürich? 😀",
        temperature: 0.7,
        tiny: 1.5e-5,
        big: 1e16,
        n: 3,
      },
      task_data: { b: [1, 2.5, null, true], a: 'x\ny\u007f' },
    },
  };

  it('matches Python json.dumps(sort_keys=True) byte for byte', () => {
    expect(canonicalPythonJson(task)).toBe(
      '{"task_id":{"task_id":"t1","taskset":"weather"},"task_input":{"responses_create_params":{"big":1e+16,"input":"Qu\'il fait \\u00e0 Z\\u00fcrich? \\ud83d\\ude00","n":3,"temperature":0.7,"tiny":1.5e-05},"task_data":{"a":"x\\ny\\u007f","b":[1,2.5,null,true]}}}',
    );
    expect(taskDigest(task)).toBe(
      '790a48cbf259d92facdf67431aa3452b2cf39c14c4dd3915b212086e9e0d077a',
    );
  });

  it('sorts keys by code point as Python does, also beside keys above the BMP', () => {
    // UTF-16 order puts U+1F600 (a surrogate pair) before U+FF61; code-point order after it.
    expect(canonicalPythonJson({ '\u{1F600}': 1, '\uFF61': 2, b: 3, a: 4 })).toBe(
      '{"a":4,"b":3,"\\uff61":2,"\\ud83d\\ude00":1}',
    );
    expect(canonicalPythonJson({ b: 1, B: 2, a: { z: 1, é: 2 } })).toBe(
      '{"B":2,"a":{"z":1,"\\u00e9":2},"b":1}',
    );
  });

  it('does not depend on key order', () => {
    const reordered = {
      task_input: task.task_input,
      task_id: { task_id: 't1', taskset: 'weather' },
    };
    expect(taskDigest(reordered)).toBe(taskDigest(task));
  });
});
