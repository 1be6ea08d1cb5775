import { jest } from '@jest/globals';
import fc from 'fast-check';

import { CheckpointError, DeadlineExceededError, StaleAttemptError } from '../src/errors.js';
import {
  EpisodeSteps,
  isBlocking,
  RecordedBoundary,
  smallestKeys,
  type EpisodeContext,
  type EpisodeState,
} from '../src/steps.js';
import { MAX_REPORTED_BLOCKERS } from '../src/participant.js';

interface Gate<T = void> {
  promise: Promise<T>;
  resolve: (value: T) => void;
  reject: (err: unknown) => void;
}

function gate<T = void>(): Gate<T> {
  let resolve!: (value: T) => void;
  let reject!: (err: unknown) => void;
  const promise = new Promise<T>((res, rej) => {
    resolve = res;
    reject = rej;
  });
  return { promise, resolve, reject };
}

/** Lets every pending promise chain run (setImmediate fires after the microtask queue drains). */
const flush = () => new Promise<void>((resolve) => setImmediate(resolve));

/** Resolves when `signal` aborts. */
const aborted = (signal: AbortSignal) =>
  new Promise<void>((resolve) => signal.addEventListener('abort', () => resolve(), { once: true }));

/** Tracks whether a promise has settled, and how. */
function watch<T>(promise: Promise<T>) {
  const seen: { settled: boolean; value?: T; error?: unknown } = { settled: false };
  promise.then(
    (value) => Object.assign(seen, { settled: true, value }),
    (error: unknown) => Object.assign(seen, { settled: true, error }),
  );
  return seen;
}

describe('a recorded boundary', () => {
  test('builds its builder once and encodes once; recording a new one drops both', () => {
    const build = jest.fn(() => ({ n: 1 }));
    const recorded = new RecordedBoundary();
    expect(recorded.recorded).toBe(false);
    expect(recorded.json()).toBe('null');
    recorded.set(build);
    expect(recorded.recorded).toBe(true);
    expect(build).not.toHaveBeenCalled();
    const value = recorded.value();
    expect(recorded.value()).toBe(value);
    expect(recorded.json()).toBe('{"n":1}');
    // The text is kept: changing the built value in place (nothing may) does not show.
    (value as { n: number }).n = 2;
    expect(recorded.json()).toBe('{"n":1}');
    expect(build).toHaveBeenCalledTimes(1);
    recorded.set({ n: 3 });
    expect(recorded.json()).toBe('{"n":3}');
  });
});

describe('the blocking rule', () => {
  test.each<[EpisodeState, boolean, boolean, boolean]>([
    ['running', false, false, true],
    ['wait_step', false, false, true],
    ['replay_step', false, false, false],
    ['parked', false, false, false],
    ['running', false, true, false],
    ['wait_step', false, true, false],
    ['parked', true, false, true],
    ['replay_step', true, true, true],
  ])('state %s retired=%s restart=%s blocks=%s', (state, retired, restart, blocks) => {
    expect(isBlocking({ state, retired, restart })).toBe(blocks);
  });

  test('smallestKeys keeps the limit smallest keys in order', () => {
    fc.assert(
      fc.property(fc.uniqueArray(fc.string()), fc.nat(20), (keys, limit) => {
        expect(smallestKeys(keys, limit)).toEqual([...keys].sort().slice(0, limit));
      }),
      { numRuns: 200 },
    );
  });
});

describe('boundaries and parking', () => {
  test('a running episode blocks and a parked one does not', async () => {
    const steps = new EpisodeSteps();
    const go = gate();
    const run = steps.run('a', {}, async (ep) => {
      await go.promise;
      await ep.boundary({ n: 1 });
    });
    expect(steps.blockerCount()).toBe(1);
    expect(steps.blockers()).toEqual(['a']);
    steps.close();
    go.resolve();
    await flush();
    expect(steps.state('a')?.state).toBe('parked');
    expect(steps.blockerCount()).toBe(0);
    expect(steps.blockers()).toEqual([]);
    steps.open();
    await run;
  });

  test('boundary returns at once while admission is open', async () => {
    const steps = new EpisodeSteps();
    const hold = gate();
    let reached = false;
    const run = steps.run('a', {}, async (ep) => {
      await ep.boundary({ n: 1 });
      reached = true;
      await hold.promise;
    });
    await flush();
    expect(reached).toBe(true);
    expect(steps.state('a')?.state).toBe('running');
    hold.resolve();
    await run;
  });

  test('boundary parks while a checkpoint is open and continues, blocking again, after open', async () => {
    const steps = new EpisodeSteps();
    const hold = gate();
    let reached = false;
    steps.close();
    const run = steps.run('a', {}, async (ep) => {
      await ep.boundary({ n: 1 });
      reached = true;
      await hold.promise;
    });
    await flush();
    expect(reached).toBe(false);
    expect(steps.exported()).toEqual(new Map([['a', { n: 1 }]]));
    steps.open();
    await flush();
    expect(reached).toBe(true);
    expect(steps.blockerCount()).toBe(1);
    hold.resolve();
    await run;
  });

  test('a new checkpoint closing before the wake-up parks the episode again', async () => {
    const steps = new EpisodeSteps();
    let reached = false;
    steps.close();
    const run = steps.run('a', {}, async (ep) => {
      await ep.boundary({ n: 1 });
      reached = true;
    });
    await flush();
    steps.open();
    steps.close();
    await flush();
    expect(reached).toBe(false);
    expect(steps.state('a')?.state).toBe('parked');
    expect(steps.blockerCount()).toBe(0);
    steps.open();
    await run;
    expect(reached).toBe(true);
  });

  test('a lazy boundary is built only once its episode is where a checkpoint exports it', async () => {
    const steps = new EpisodeSteps();
    const running = jest.fn(() => ({ stage: 'plan' }));
    const parked = jest.fn(() => ({ stage: 'verify' }));
    const atBoundary = gate();
    const hold = gate();
    const run = steps.run('a', {}, async (ep) => {
      await ep.boundary(running);
      await atBoundary.promise;
      await ep.boundary(parked);
      await hold.promise;
    });
    await flush();
    expect(running).not.toHaveBeenCalled();
    steps.close();
    atBoundary.resolve();
    await flush();
    await flush(); // the idle turn that encodes
    expect(steps.state('a')?.state).toBe('parked');
    // Built (and encoded) in an idle turn, ahead of the commit; the export reuses it.
    expect(parked).toHaveBeenCalledTimes(1);
    expect(steps.exported()).toEqual(new Map([['a', { stage: 'verify' }]]));
    expect(steps.boundaryJson('a')).toBe('{"stage":"verify"}');
    expect(parked).toHaveBeenCalledTimes(1);
    expect(running).not.toHaveBeenCalled();
    steps.open();
    hold.resolve();
    await run;
  });

  test('with a settle time, a boundary is not encoded ahead while admission is open and the episode has not settled; closing admission encodes it at once', async () => {
    const steps = new EpisodeSteps({ encodeAheadSettleMs: 60_000 });
    const first = jest.fn(() => ({ n: 1 }));
    const stepDone = gate();
    const run = steps.run('a', {}, async (ep) => {
      await ep.boundary(first);
      await ep.step('replay', () => stepDone.promise);
    });
    await flush();
    await flush();
    expect(steps.state('a')?.state).toBe('replay_step');
    expect(first).not.toHaveBeenCalled();
    steps.close();
    await flush();
    expect(first).toHaveBeenCalledTimes(1);
    expect(steps.boundaryJson('a')).toBe('{"n":1}');
    expect(first).toHaveBeenCalledTimes(1);
    steps.open();
    stepDone.resolve();
    await run;
  });

  test('the boundary before a replay step is encoded ahead, and a new boundary is encoded afresh', async () => {
    const steps = new EpisodeSteps();
    const first = jest.fn(() => ({ n: 1 }));
    const stepDone = gate();
    const afterStep = gate();
    const run = steps.run('a', {}, async (ep) => {
      await ep.boundary(first);
      await ep.step('replay', () => stepDone.promise);
      await ep.boundary({ n: 2 });
      await afterStep.promise;
    });
    await flush();
    await flush(); // the idle turn that encodes
    expect(steps.state('a')?.state).toBe('replay_step');
    expect(first).toHaveBeenCalledTimes(1);
    expect(steps.boundaryJson('a')).toBe('{"n":1}');
    stepDone.resolve();
    await flush();
    expect(steps.state('a')?.state).toBe('running');
    expect(steps.boundaryJson('a')).toBe('{"n":2}');
    expect(steps.boundaryJson('missing')).toBeUndefined();
    afterStep.resolve();
    await run;
  });
});

describe('steps', () => {
  test('a wait step blocks the checkpoint until it ends, and the episode then parks at the next boundary', async () => {
    const steps = new EpisodeSteps();
    const stepDone = gate();
    let reached = false;
    const run = steps.run('a', {}, async (ep) => {
      await ep.boundary({ n: 1 });
      await ep.step('wait', () => stepDone.promise);
      await ep.boundary({ n: 2 });
      reached = true;
    });
    await flush();
    steps.close();
    expect(steps.state('a')?.state).toBe('wait_step');
    expect(steps.blockerCount()).toBe(1);
    expect(steps.exported().size).toBe(0);
    stepDone.resolve();
    await flush();
    expect(steps.blockerCount()).toBe(0);
    expect(steps.exported()).toEqual(new Map([['a', { n: 2 }]]));
    expect(reached).toBe(false);
    steps.open();
    await run;
  });

  test('a replay step does not block, is exported with the boundary before it, and its next boundary parks with the new state', async () => {
    const steps = new EpisodeSteps();
    const stepDone = gate();
    const afterStep = gate();
    const run = steps.run('a', {}, async (ep) => {
      await ep.boundary({ n: 1 });
      await ep.step('replay', () => stepDone.promise);
      await afterStep.promise;
      await ep.boundary({ n: 2 });
    });
    await flush();
    steps.close();
    expect(steps.blockerCount()).toBe(0);
    expect(steps.exported()).toEqual(new Map([['a', { n: 1 }]]));
    stepDone.resolve();
    await flush();
    expect(steps.state('a')?.state).toBe('replay_step');
    expect(steps.blockerCount()).toBe(0);
    expect(steps.exported()).toEqual(new Map([['a', { n: 1 }]]));
    afterStep.resolve();
    await flush();
    expect(steps.state('a')?.state).toBe('parked');
    expect(steps.exported()).toEqual(new Map([['a', { n: 2 }]]));
    steps.open();
    await run;
  });

  test('a replay step that completed during a checkpoint blocks again at its next boundary after resume', async () => {
    const steps = new EpisodeSteps();
    const stepDone = gate();
    const afterStep = gate();
    const hold = gate();
    steps.close();
    const run = steps.run('a', {}, async (ep) => {
      await ep.step('replay', () => stepDone.promise);
      await afterStep.promise;
      await ep.boundary({ n: 1 });
      await hold.promise;
    });
    stepDone.resolve();
    await flush();
    steps.open();
    expect(steps.blockerCount()).toBe(0);
    afterStep.resolve();
    await flush();
    expect(steps.state('a')?.state).toBe('running');
    expect(steps.blockerCount()).toBe(1);
    hold.resolve();
    await run;
  });

  test('a replay step that ends while admission is open leaves the episode running and blocking', async () => {
    const steps = new EpisodeSteps();
    const hold = gate();
    const run = steps.run('a', {}, async (ep) => {
      await ep.step('replay', async () => undefined);
      await hold.promise;
    });
    await flush();
    expect(steps.state('a')?.state).toBe('running');
    expect(steps.blockerCount()).toBe(1);
    hold.resolve();
    await run;
  });

  test('a replay step that fails during a checkpoint clears the boundary and its failure propagates only after resume', async () => {
    const steps = new EpisodeSteps();
    const stepDone = gate();
    const failure = new Error('activation failed');
    const run = watch(
      steps.run('a', {}, async (ep) => {
        await ep.boundary({ n: 1 });
        await ep.step('replay', () => stepDone.promise);
      }),
    );
    await flush();
    steps.close();
    stepDone.reject(failure);
    await flush();
    expect(run.settled).toBe(false);
    expect(steps.blockerCount()).toBe(0);
    expect(steps.exported()).toEqual(new Map([['a', null]]));
    steps.open();
    await flush();
    expect(run).toEqual({ settled: true, error: failure });
    expect(steps.has('a')).toBe(false);
  });

  test('a wait step that failed keeps blocking until the episode ends', async () => {
    const steps = new EpisodeSteps();
    const cleanup = gate();
    steps.close();
    const run = steps.run('a', {}, async (ep) => {
      await ep.step('wait', () => Promise.reject(new Error('boom'))).catch(() => undefined);
      await cleanup.promise;
    });
    await flush();
    expect(steps.state('a')?.state).toBe('running');
    expect(steps.blockerCount()).toBe(1);
    cleanup.resolve();
    await run;
    expect(steps.blockerCount()).toBe(0);
  });
});

describe('what a checkpoint exports', () => {
  test('an episode with no boundary yet is exported to start over (null)', async () => {
    const steps = new EpisodeSteps();
    const stepDone = gate();
    const run = steps.run('a', {}, (ep) => ep.step('replay', () => stepDone.promise));
    steps.close();
    expect(steps.exported()).toEqual(new Map([['a', null]]));
    steps.open();
    stepDone.resolve();
    await run;
  });

  test('a restored episode is exported at its restored boundary and its continuation is handed out once', async () => {
    const steps = new EpisodeSteps();
    const stepDone = gate();
    const handedOut: unknown[] = [];
    const run = steps.run('r-a1', { continuation: { stage: 'verify' } }, async (ep) => {
      handedOut.push(ep.continuation(), ep.continuation());
      await ep.step('replay', () => stepDone.promise);
    });
    steps.close();
    expect(handedOut).toEqual([{ stage: 'verify' }, null]);
    expect(steps.exported()).toEqual(new Map([['r-a1', { stage: 'verify' }]]));
    steps.open();
    stepDone.resolve();
    await run;
  });
});

describe('deadlines', () => {
  beforeEach(() => {
    jest.useFakeTimers({ doNotFake: ['setImmediate', 'nextTick', 'queueMicrotask'] });
  });
  afterEach(() => {
    jest.useRealTimers();
  });

  test('the deadline aborts the signal with deadline_exceeded', async () => {
    const steps = new EpisodeSteps();
    let signal: AbortSignal | undefined;
    const run = watch(
      steps.run('a', { deadlineSeconds: 0.1 }, async (ep) => {
        signal = ep.signal;
        await aborted(ep.signal);
        throw ep.signal.reason;
      }),
    );
    await jest.advanceTimersByTimeAsync(150);
    expect(signal?.reason).toBeInstanceOf(DeadlineExceededError);
    expect((signal?.reason as DeadlineExceededError).code).toBe('deadline_exceeded');
    expect(run.error).toBe(signal?.reason);
  });

  test('time parked for a checkpoint does not count against the deadline', async () => {
    const steps = new EpisodeSteps();
    let signal: AbortSignal | undefined;
    steps.close();
    const run = steps.run('a', { deadlineSeconds: 0.2 }, async (ep) => {
      signal = ep.signal;
      await ep.boundary({ n: 1 });
      await aborted(ep.signal);
    });
    await jest.advanceTimersByTimeAsync(1000);
    expect(signal?.aborted).toBe(false);
    steps.open();
    await jest.advanceTimersByTimeAsync(100);
    expect(signal?.aborted).toBe(false);
    await jest.advanceTimersByTimeAsync(150);
    expect(signal?.aborted).toBe(true);
    await run;
  });

  test('time inside a replay step during a checkpoint does not count against the deadline', async () => {
    const steps = new EpisodeSteps();
    let signal: AbortSignal | undefined;
    steps.close();
    const run = steps.run('a', { deadlineSeconds: 0.2 }, async (ep) => {
      signal = ep.signal;
      await ep.step('replay', () => aborted(ep.signal));
    });
    await jest.advanceTimersByTimeAsync(1000);
    expect(signal?.aborted).toBe(false);
    steps.open();
    await jest.advanceTimersByTimeAsync(250);
    expect(signal?.aborted).toBe(true);
    await run;
  });

  test('a replay step already running when a checkpoint closes stops counting against the deadline', async () => {
    const steps = new EpisodeSteps();
    let signal: AbortSignal | undefined;
    const run = steps.run('a', { deadlineSeconds: 0.2 }, async (ep) => {
      signal = ep.signal;
      await ep.step('replay', () => aborted(ep.signal));
    });
    steps.close();
    await jest.advanceTimersByTimeAsync(1000);
    expect(signal?.aborted).toBe(false);
    steps.open();
    await jest.advanceTimersByTimeAsync(250);
    expect(signal?.aborted).toBe(true);
    await run;
  });

  test('a deadline passing while waiting to be marked a restart ends the wait', async () => {
    const steps = new EpisodeSteps();
    steps.close();
    const run = watch(
      steps.run('a', { deadlineSeconds: 0.1 }, (ep) => ep.step('wait', () => ep.markRestart())),
    );
    await jest.advanceTimersByTimeAsync(150);
    expect(run.error).toBeInstanceOf(DeadlineExceededError);
    steps.open();
  });

  test('time inside a wait step during a checkpoint counts against the deadline', async () => {
    const steps = new EpisodeSteps();
    let signal: AbortSignal | undefined;
    steps.close();
    const run = steps.run('a', { deadlineSeconds: 0.2 }, async (ep) => {
      signal = ep.signal;
      await ep.step('wait', () => aborted(ep.signal));
    });
    await jest.advanceTimersByTimeAsync(250);
    expect(signal?.aborted).toBe(true);
    steps.open();
    await run;
  });
});

describe('restarts', () => {
  test('markRestart waits while a checkpoint is open', async () => {
    const steps = new EpisodeSteps();
    const hold = gate();
    steps.close();
    const run = steps.run('a', {}, async (ep) => {
      await ep.step('replay', () => ep.markRestart());
      await hold.promise;
    });
    await flush();
    expect(steps.restarts()).toEqual([]);
    expect(steps.state('a')?.restart).toBe(false);
    steps.open();
    await flush();
    expect(steps.restarts()).toEqual(['a']);
    hold.resolve();
    await run;
  });

  test('a restart never blocks, never parks and is never exported', async () => {
    const steps = new EpisodeSteps();
    const stepDone = gate();
    let reached = 0;
    steps.close();
    const runs = (['wait', 'replay'] as const).map((mode) =>
      steps.run(mode, { restart: true }, async (ep) => {
        await ep.boundary({ n: 1 });
        reached += 1;
        await ep.step(mode, () => stepDone.promise);
      }),
    );
    await flush();
    expect(reached).toBe(2);
    expect(steps.state('wait')?.state).toBe('wait_step');
    expect(steps.state('replay')?.state).toBe('replay_step');
    expect(steps.blockerCount()).toBe(0);
    expect(steps.exported().size).toBe(0);
    expect(steps.restarts()).toEqual(['replay', 'wait']);
    stepDone.resolve();
    await Promise.all(runs);
    steps.open();
  });

  test('an episode marked a restart stops blocking', async () => {
    const steps = new EpisodeSteps();
    const hold = gate();
    const run = steps.run('a', {}, async (ep) => {
      await ep.markRestart();
      await hold.promise;
    });
    await flush();
    expect(steps.blockerCount()).toBe(0);
    hold.resolve();
    await run;
  });
});

describe('retire', () => {
  test('retire aborts the episode, waits for its work to end, then forgets it', async () => {
    const steps = new EpisodeSteps();
    const cleanup = gate();
    let signal: AbortSignal | undefined;
    const run = steps.run('a', {}, async (ep) => {
      signal = ep.signal;
      await aborted(ep.signal);
      await cleanup.promise;
    });
    const retire = watch(steps.retire('a'));
    await flush();
    expect(signal?.reason).toBeInstanceOf(StaleAttemptError);
    expect(retire.settled).toBe(false);
    expect(steps.has('a')).toBe(true);
    expect(steps.blockers()).toEqual(['a']);
    cleanup.resolve();
    await flush();
    expect(retire).toEqual({ settled: true, value: undefined });
    expect(steps.has('a')).toBe(false);
    expect(steps.blockerCount()).toBe(0);
    await run;
  });

  test('finishing makes a retire wait for the cleanup and never abort it', async () => {
    const steps = new EpisodeSteps();
    const cleanup = gate();
    let signal: AbortSignal | undefined;
    const run = steps.run('a', {}, async (ep) => {
      signal = ep.signal;
      ep.finishing();
      await cleanup.promise;
    });
    const retire = watch(steps.retire('a'));
    await flush();
    expect(signal?.aborted).toBe(false);
    expect(retire.settled).toBe(false);
    cleanup.resolve();
    await flush();
    expect(retire.settled).toBe(true);
    await run;
  });

  test('a retire cut short leaves the episode tracked, blocking and refused again; a retry waits for its end', async () => {
    const steps = new EpisodeSteps();
    const cleanup = gate();
    const run = steps.run('a', {}, async (ep) => {
      await aborted(ep.signal);
      await cleanup.promise;
    });
    const stop = new AbortController();
    const first = watch(steps.retire('a', stop.signal));
    const reason = new Error('retire deadline');
    stop.abort(reason);
    await flush();
    expect(first).toEqual({ settled: true, error: reason });
    expect(steps.has('a')).toBe(true);
    expect(steps.blockers()).toEqual(['a']);
    await expect(steps.run('a', {}, async () => undefined)).rejects.toBeInstanceOf(CheckpointError);
    const retry = watch(steps.retire('a'));
    await flush();
    expect(retry.settled).toBe(false);
    cleanup.resolve();
    await flush();
    expect(retry.settled).toBe(true);
    expect(steps.has('a')).toBe(false);
    await run;
  });

  test('a retired episode is never exported while it is still ending', async () => {
    const steps = new EpisodeSteps();
    const stepDone = gate();
    const run = steps.run('a', {}, async (ep) => {
      ep.finishing();
      await ep.step('replay', () => stepDone.promise);
    });
    steps.close();
    expect(steps.exported().has('a')).toBe(true);
    const retire = steps.retire('a');
    expect(steps.exported().size).toBe(0);
    expect(steps.blockers()).toEqual(['a']);
    stepDone.resolve();
    await retire;
    steps.open();
    await run;
  });

  test('a retired restart blocks until it ends and is no longer listed as a restart', async () => {
    const steps = new EpisodeSteps();
    const cleanup = gate();
    const run = steps.run('a', { restart: true }, async (ep) => {
      ep.finishing();
      await cleanup.promise;
    });
    const retire = steps.retire('a');
    expect(steps.blockerCount()).toBe(1);
    expect(steps.restarts()).toEqual([]);
    cleanup.resolve();
    await retire;
    await run;
  });

  test('a retired parked episode wakes with stale_attempt', async () => {
    const steps = new EpisodeSteps();
    steps.close();
    const run = watch(steps.run('a', {}, (ep) => ep.boundary({ n: 1 })));
    await flush();
    await steps.retire('a');
    expect(run.error).toBeInstanceOf(StaleAttemptError);
    expect((run.error as Error).message).toBe('episode a was retired while parked');
    expect(steps.has('a')).toBe(false);
  });

  test('a retire wakes a parked episode even while it is finishing', async () => {
    const steps = new EpisodeSteps();
    steps.close();
    const run = watch(
      steps.run('a', {}, async (ep) => {
        ep.finishing();
        await ep.boundary({ n: 1 });
      }),
    );
    await flush();
    await steps.retire('a');
    expect(run.error).toBeInstanceOf(StaleAttemptError);
  });

  test('a retire stops an episode parked after its replay step failed', async () => {
    const steps = new EpisodeSteps();
    const failure = new Error('activation failed');
    steps.close();
    const run = watch(steps.run('a', {}, (ep) => ep.step('replay', () => Promise.reject(failure))));
    await flush();
    expect(run.settled).toBe(false);
    await steps.retire('a');
    expect(run.error).toBeInstanceOf(StaleAttemptError);
    expect((run.error as Error).cause).toBe(failure);
  });

  test('a retire wakes an episode waiting to be marked a restart', async () => {
    const steps = new EpisodeSteps();
    steps.close();
    const run = watch(steps.run('a', {}, (ep) => ep.step('replay', () => ep.markRestart())));
    await flush();
    await steps.retire('a');
    expect(run.error).toBeInstanceOf(StaleAttemptError);
  });

  test('retiring an unknown key returns at once', async () => {
    await expect(new EpisodeSteps().retire('nobody')).resolves.toBeUndefined();
  });
});

describe('tracking', () => {
  test('a duplicate key is refused and the refused call owns nothing', async () => {
    const steps = new EpisodeSteps();
    const hold = gate();
    const run = steps.run('a', {}, () => hold.promise);
    const second = jest.fn(async () => undefined);
    const refused = steps.run('a', {}, second);
    await expect(refused).rejects.toBeInstanceOf(CheckpointError);
    await expect(refused).rejects.toThrow('episode a is already running');
    expect(second).not.toHaveBeenCalled();
    expect(steps.has('a')).toBe(true);
    expect(steps.blockerCount()).toBe(1);
    hold.resolve();
    await run;
    expect(steps.has('a')).toBe(false);
  });

  test('an episode whose work throws is forgotten and its failure reaches the caller', async () => {
    const steps = new EpisodeSteps();
    const failure = new Error('boom');
    await expect(
      steps.run('a', {}, () => {
        throw failure;
      }),
    ).rejects.toBe(failure);
    expect(steps.size).toBe(0);
    expect(steps.blockerCount()).toBe(0);
  });

  test('blockers lists at most the limit, sorted', async () => {
    const steps = new EpisodeSteps();
    const hold = gate();
    const keys = ['d', 'b', 'e', 'a', 'c'];
    const runs = keys.map((key) => steps.run(key, {}, () => hold.promise));
    expect(steps.blockerCount()).toBe(5);
    expect(steps.blockers(3)).toEqual(['a', 'b', 'c']);
    expect(steps.blockers()).toEqual(['a', 'b', 'c', 'd', 'e']);
    hold.resolve();
    await Promise.all(runs);
  });

  test('blockers lists MAX_REPORTED_BLOCKERS by default', async () => {
    const steps = new EpisodeSteps();
    const hold = gate();
    const runs = Array.from({ length: MAX_REPORTED_BLOCKERS + 5 }, (_, i) =>
      steps.run(`k${String(i).padStart(4, '0')}`, {}, () => hold.promise),
    );
    expect(steps.blockers()).toHaveLength(MAX_REPORTED_BLOCKERS);
    expect(steps.blockers()[0]).toBe('k0000');
    hold.resolve();
    await Promise.all(runs);
  });

  test('onChange is called only while a checkpoint is open', async () => {
    const onChange = jest.fn();
    const steps = new EpisodeSteps({ onChange });
    const run = steps.run('a', {}, async (ep: EpisodeContext) => {
      await ep.boundary({ n: 1 });
      await ep.step('wait', async () => undefined);
      await ep.boundary({ n: 2 });
      await ep.step('replay', async () => undefined);
      steps.close();
      await ep.boundary({ n: 3 });
    });
    await flush();
    expect(onChange).toHaveBeenCalled();
    const callsWhileClosed = onChange.mock.calls.length;
    onChange.mockClear();
    steps.open();
    await run;
    expect(callsWhileClosed).toBeGreaterThan(0);
    expect(onChange).not.toHaveBeenCalled();
  });
});

describe('the blocker count', () => {
  type Command = 'boundary' | 'wait' | 'replay' | 'replayFail' | 'restart' | 'finishing' | 'end';
  type Op =
    | { op: 'run'; key: string; restart: boolean }
    | { op: 'cmd'; key: string; cmd: Command }
    | { op: 'close' }
    | { op: 'open' }
    | { op: 'retire'; key: string; cutShort: boolean };

  /** Commands for one episode's scripted work; `drain` ends it at its next wait. */
  class Inbox {
    private queue: Command[] = [];
    private waiter: (() => void) | undefined;
    drain = false;

    push(cmd: Command): void {
      this.queue.push(cmd);
      this.waiter?.();
    }

    finish(): void {
      this.drain = true;
      this.waiter?.();
    }

    async next(signal: AbortSignal | undefined): Promise<Command> {
      while (true) {
        if (this.drain) return 'end';
        if (signal?.aborted) throw signal.reason;
        const cmd = this.queue.shift();
        if (cmd) return cmd;
        await new Promise<void>((resolve) => {
          this.waiter = resolve;
          signal?.addEventListener('abort', () => resolve(), { once: true });
        });
      }
    }
  }

  async function script(ep: EpisodeContext, inbox: Inbox): Promise<void> {
    let n = 0;
    while (true) {
      // A retire aborts the signal unless finishing; then only commands (or the drain) end it.
      const cmd = await inbox.next(ep.signal);
      if (cmd === 'end') return;
      if (cmd === 'boundary') await ep.boundary({ n: (n += 1) });
      if (cmd === 'restart') await ep.markRestart();
      if (cmd === 'finishing') ep.finishing();
      if (cmd === 'wait' || cmd === 'replay' || cmd === 'replayFail') {
        await ep
          .step(cmd === 'wait' ? 'wait' : 'replay', async () => {
            await inbox.next(ep.signal);
            if (cmd === 'replayFail') throw new Error('step failed');
          })
          .catch(() => undefined);
      }
    }
  }

  const keyArb = fc.constantFrom('a', 'b');
  const opArb: fc.Arbitrary<Op> = fc.oneof(
    fc.record({ op: fc.constant('run' as const), key: keyArb, restart: fc.boolean() }),
    {
      arbitrary: fc.record({
        op: fc.constant('cmd' as const),
        key: keyArb,
        cmd: fc.oneof(
          { arbitrary: fc.constantFrom<Command>('boundary', 'replay'), weight: 4 },
          {
            arbitrary: fc.constantFrom<Command>(
              'wait',
              'replayFail',
              'restart',
              'finishing',
              'end',
            ),
            weight: 3,
          },
        ),
      }),
      weight: 4,
    },
    fc.constant({ op: 'close' as const }),
    fc.constant({ op: 'open' as const }),
    fc.record({ op: fc.constant('retire' as const), key: keyArb, cutShort: fc.boolean() }),
  );

  function checkCount(steps: EpisodeSteps): void {
    const recount = [...steps.keys()].filter((key) => isBlocking(steps.state(key)!)).sort();
    expect(steps.blockerCount()).toBe(recount.length);
    expect(steps.blockers(Infinity)).toEqual(recount);
    for (const key of steps.exported().keys()) expect(recount).not.toContain(key);
  }

  test('the maintained blocker count always equals a recount', async () => {
    await fc.assert(
      fc.asyncProperty(fc.array(opArb, { maxLength: 50, size: 'max' }), async (ops) => {
        const steps = new EpisodeSteps();
        const inboxes = new Map<string, Inbox>();
        const pending: Promise<unknown>[] = [];
        for (const op of ops) {
          if (op.op === 'run') {
            const inbox = new Inbox();
            const tracked = steps.has(op.key);
            const run = steps.run(op.key, { restart: op.restart }, (ep) => script(ep, inbox));
            if (tracked) await expect(run).rejects.toBeInstanceOf(CheckpointError);
            else {
              inboxes.set(op.key, inbox);
              pending.push(run.catch(() => undefined));
            }
          } else if (op.op === 'cmd') {
            inboxes.get(op.key)?.push(op.cmd);
          } else if (op.op === 'close') {
            steps.close();
          } else if (op.op === 'open') {
            steps.open();
          } else {
            const stop = new AbortController();
            pending.push(steps.retire(op.key, stop.signal).catch(() => undefined));
            if (op.cutShort) stop.abort();
          }
          await flush();
          checkCount(steps);
        }
        steps.open();
        for (const inbox of inboxes.values()) inbox.finish();
        await Promise.all(pending);
        checkCount(steps);
        expect(steps.size).toBe(0);
      }),
      {
        numRuns: 150,
        examples: [
          [
            [
              { op: 'run', key: 'a', restart: false },
              { op: 'cmd', key: 'a', cmd: 'replay' },
              { op: 'close' },
              { op: 'cmd', key: 'a', cmd: 'end' },
              { op: 'open' },
              { op: 'cmd', key: 'a', cmd: 'boundary' },
            ],
          ],
        ],
      },
    );
  });
});
