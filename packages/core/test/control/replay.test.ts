import {
  callArgs,
  PREPARE_ARGS,
  RecentIds,
  RecordedReplies,
  sameArgs,
} from '../../src/control/replay.js';
import { CheckpointConflictError } from '../../src/errors.js';
import { parseCaptureKey } from '../../src/identity.js';

function args(dir: string, keys: string[] | null) {
  return callArgs(dir, keys === null ? null : keys.map(parseCaptureKey));
}

describe('call arguments', () => {
  test('the same directory and scope match in any order, attempts included', () => {
    expect(sameArgs(args('/d', ['a', 'b-a2']), args('/d', ['b-a2', 'a']))).toBe(true);
    expect(sameArgs(args('/d', ['a', 'b-a2']), args('/d', ['a', 'b-a3']))).toBe(false);
  });

  test('another directory, a larger or smaller scope, or null against a scope do not match', () => {
    expect(sameArgs(args('/d', ['a']), args('/e', ['a']))).toBe(false);
    expect(sameArgs(args('/d', ['a']), args('/d', ['a', 'b']))).toBe(false);
    expect(sameArgs(args('/d', ['a', 'b']), args('/d', ['a']))).toBe(false);
    expect(sameArgs(args('/d', null), args('/d', []))).toBe(false);
    expect(sameArgs(args('/d', []), args('/d', null))).toBe(false);
    expect(sameArgs(args('/d', null), args('/d', null))).toBe(true);
  });
});

describe('recorded replies', () => {
  test('a retry of the same checkpoint with the same arguments gets the recorded reply', () => {
    const replies = new RecordedReplies<{ commit: { n: number }; prepare: { p: string } }>();
    const reply = { n: 1 };
    replies.record('commit', 'c1', args('/d', ['a', 'b']), reply);
    expect(replies.replay('commit', 'c1', args('/d', ['b', 'a']))).toBe(reply);
    expect(replies.replay('prepare', 'c1', PREPARE_ARGS)).toBeUndefined();
    expect(replies.replay('commit', 'c2', args('/d', ['a', 'b']))).toBeUndefined();
  });

  test('a retry with another directory or scope conflicts', () => {
    const replies = new RecordedReplies<{ restore: { n: number } }>();
    replies.record('restore', 'c1', args('/d', ['a']), { n: 1 });
    expect(() => replies.replay('restore', 'c1', args('/e', ['a']))).toThrow(
      CheckpointConflictError,
    );
    expect(() => replies.replay('restore', 'c1', args('/d', ['a', 'b']))).toThrow(
      'checkpoint c1 already completed restore with another directory or scope',
    );
  });

  test('clear forgets every reply', () => {
    const replies = new RecordedReplies<{ commit: { n: number } }>();
    replies.record('commit', 'c1', args('/d', null), { n: 1 });
    replies.clear();
    expect(replies.replay('commit', 'c1', args('/e', null))).toBeUndefined();
  });
});

describe('recent ids', () => {
  test('keeps the last `capacity` ids, evicting the oldest added', () => {
    const ids = new RecentIds(2);
    ids.add('a');
    ids.add('b');
    // Adding an id already held does not make it newer.
    ids.add('a');
    ids.add('c');
    expect(ids.has('a')).toBe(false);
    expect(ids.has('b')).toBe(true);
    expect(ids.has('c')).toBe(true);
  });
});
