import { InvalidRequestError } from '@ckpt-gym/core/protocol';

import {
  NO_HOLD,
  WaitQueue,
  parseGateBody,
  parseHoldBody,
  parseKeepAliveBody,
  parseReleaseBody,
  parseStepBody,
  waitReason,
} from '../src/holds.js';

describe('waitReason', () => {
  test('after_calls holds every call whose global index is at least n', () => {
    const hold = { ...NO_HOLD, after_calls: 2 };
    expect(waitReason(hold, false, { index: 1, rolloutCallIndex: 5 })).toBeNull();
    expect(waitReason(hold, false, { index: 2, rolloutCallIndex: 0 })).toBe('hold');
    expect(waitReason(hold, false, { index: 3, rolloutCallIndex: null })).toBe('hold');
  });

  test('after_calls_per_rollout holds a rollout beyond its first n calls and never an untagged call', () => {
    const hold = { ...NO_HOLD, after_calls_per_rollout: 1 };
    expect(waitReason(hold, false, { index: 9, rolloutCallIndex: 0 })).toBeNull();
    expect(waitReason(hold, false, { index: 1, rolloutCallIndex: 1 })).toBe('hold');
    expect(waitReason(hold, false, { index: 9, rolloutCallIndex: null })).toBeNull();
  });

  test('a closed gate makes every call wait, and a hold outranks it', () => {
    expect(waitReason(NO_HOLD, true, { index: 0, rolloutCallIndex: null })).toBe('gate');
    expect(
      waitReason({ ...NO_HOLD, after_calls: 0 }, true, { index: 0, rolloutCallIndex: null }),
    ).toBe('hold');
    expect(waitReason(NO_HOLD, false, { index: 0, rolloutCallIndex: 0 })).toBeNull();
  });
});

/** Starts `n` waits and records the order in which they are released. */
function waiters(queue: WaitQueue, reasons: ('hold' | 'gate')[], signals?: AbortSignal[]) {
  const released: number[] = [];
  const results = reasons.map((reason, i) =>
    queue.wait(reason, signals?.[i] ?? new AbortController().signal).then((ok) => {
      if (ok) released.push(i);
      return ok;
    }),
  );
  return { released, results };
}

const settle = () => new Promise((resolve) => setImmediate(resolve));

describe('WaitQueue', () => {
  test('step releases the n oldest waiting calls, whatever they wait for', async () => {
    const queue = new WaitQueue();
    const { released } = waiters(queue, ['hold', 'gate', 'hold']);
    expect(queue.step(2)).toBe(2);
    await settle();
    expect(released).toEqual([0, 1]);
    expect(queue.waiting).toBe(1);
    expect(queue.step(5)).toBe(1);
    expect(queue.waiting).toBe(0);
  });

  test('opening the gate releases only the calls that wait for the gate', async () => {
    const queue = new WaitQueue();
    queue.setGate(true);
    const { released } = waiters(queue, ['gate', 'hold', 'gate']);
    expect(queue.setGate(false)).toBe(2);
    await settle();
    expect(released).toEqual([0, 2]);
    expect(queue.waiting).toBe(1);
  });

  test('releaseAll releases everything, clears the hold and opens the gate', async () => {
    const queue = new WaitQueue();
    queue.setHold({ after_calls: 0, after_calls_per_rollout: 3, after_tokens: 0 });
    queue.setGate(true);
    const { released } = waiters(queue, ['hold', 'gate']);
    expect(queue.releaseAll()).toBe(2);
    await settle();
    expect(released).toEqual([0, 1]);
    expect(queue.hold).toEqual(NO_HOLD);
    expect(queue.gateClosed).toBe(false);
  });

  test('placing a hold again releases nothing that waits', async () => {
    const queue = new WaitQueue();
    queue.setHold({ ...NO_HOLD, after_calls: 0 });
    const { released } = waiters(queue, ['hold']);
    queue.setHold({ ...NO_HOLD, after_calls: 0 });
    await settle();
    expect(released).toEqual([]);
    expect(queue.waiting).toBe(1);
  });

  test('an aborted wait resolves false and leaves the queue, so step skips it', async () => {
    const queue = new WaitQueue();
    const gone = new AbortController();
    const { released, results } = waiters(
      queue,
      ['hold', 'hold'],
      [gone.signal, new AbortController().signal],
    );
    gone.abort();
    await expect(results[0]).resolves.toBe(false);
    expect(queue.waiting).toBe(1);
    expect(queue.step(1)).toBe(1);
    await settle();
    expect(released).toEqual([1]);
  });

  test('a wait whose signal already aborted does not queue', async () => {
    const queue = new WaitQueue();
    const gone = new AbortController();
    gone.abort();
    await expect(queue.wait('hold', gone.signal)).resolves.toBe(false);
    expect(queue.waiting).toBe(0);
  });
});

describe('control bodies', () => {
  test('hold takes either count; the other becomes null', () => {
    expect(parseHoldBody({ after_calls: 1 })).toEqual({
      after_calls: 1,
      after_calls_per_rollout: null,
      after_tokens: 0,
    });
    expect(parseHoldBody({ after_calls_per_rollout: 0 })).toEqual({
      after_calls: null,
      after_calls_per_rollout: 0,
      after_tokens: 0,
    });
  });

  test('gate closes on an empty body; step defaults to one call', () => {
    expect(parseGateBody(undefined)).toBe(true);
    expect(parseGateBody({ closed: false })).toBe(false);
    expect(parseStepBody({})).toBe(1);
    expect(parseStepBody({ calls: 3 })).toBe(3);
  });

  test.each([
    ['hold with nothing to hold', () => parseHoldBody({})],
    ['hold with a negative count', () => parseHoldBody({ after_calls: -1 })],
    ['hold with a fractional count', () => parseHoldBody({ after_calls_per_rollout: 1.5 })],
    ['hold with an unknown key', () => parseHoldBody({ after_calls: 1, after: 2 })],
    ['hold with an array body', () => parseHoldBody([1])],
    ['gate with a string', () => parseGateBody({ closed: 'yes' })],
    ['step with a string', () => parseStepBody({ calls: '2' })],
    ['release with a field', () => parseReleaseBody({ all: true })],
    ['keepalive without interval', () => parseKeepAliveBody({})],
  ])('refuses %s', (_what, parse) => {
    expect(parse).toThrow(InvalidRequestError);
  });
});
