import {
  ActivationOutOfOrderError,
  CheckpointError,
  parseActivationHeader,
} from '@ckpt-gym/core/protocol';

import {
  type ActivationView,
  decideActivation,
  invocationId,
  nextActivationCount,
} from '../src/activation.js';

const idle: ActivationView = {
  sessionId: 's',
  completedActivation: 2,
  hasStoredReply: true,
  runningIndex: null,
  running: false,
};

describe('activation index rules', () => {
  test('the header must be a positive integer', () => {
    expect(parseActivationHeader(undefined)).toBeNull();
    expect(parseActivationHeader('3')).toBe(3);
    for (const bad of ['0', '-1', 'x', '1.5', '']) {
      expect(() => parseActivationHeader(bad)).toThrow(ActivationOutOfOrderError);
    }
  });

  test('the completed index replays its stored reply; the next one runs; others are out of order', () => {
    expect(decideActivation(idle, 2)).toEqual({ kind: 'replay' });
    expect(decideActivation(idle, 3)).toEqual({ kind: 'new', index: 3 });
    expect(() => decideActivation(idle, 1)).toThrow(ActivationOutOfOrderError);
    expect(() => decideActivation(idle, 4)).toThrow(ActivationOutOfOrderError);
    expect(() => decideActivation({ ...idle, hasStoredReply: false }, 2)).toThrow(
      ActivationOutOfOrderError,
    );
  });

  test('a request for the running activation waits; another while one runs is refused', () => {
    const running = { ...idle, running: true, runningIndex: 3 };
    expect(decideActivation(running, 3)).toEqual({ kind: 'wait' });
    expect(() => decideActivation(running, null)).toThrow(CheckpointError);
    expect(() => decideActivation({ ...running, runningIndex: null }, 3)).toThrow(CheckpointError);
  });

  test('without the header every invocation is a new activation', () => {
    expect(decideActivation(idle, null)).toEqual({ kind: 'new', index: null });
  });

  test('invocation ids: root, then activation-n; a continued activation keeps its count', () => {
    expect(invocationId(1)).toBe('root');
    expect(invocationId(2)).toBe('activation-2');
    expect(nextActivationCount(1, null, false)).toBe(2);
    expect(nextActivationCount(1, 2, false)).toBe(2);
    expect(nextActivationCount(2, 2, true)).toBe(2);
  });
});
