import { closest, didYouMean, editDistance } from '../src/suggest.js';

describe('editDistance', () => {
  test.each([
    ['', '', 0],
    ['', 'up', 2],
    ['down', '', 4],
    ['status', 'status', 0],
    ['confg', 'config', 1], // an insertion
    ['configg', 'config', 1], // a deletion
    ['stetus', 'status', 1], // a substitution
    ['stauts', 'status', 1], // a swap of neighbours counts once
    ['pu', 'up', 1],
    ['kitten', 'sitting', 3],
    ['frobnicate', 'status', 9],
  ])('%j to %j is %i', (a, b, distance) => {
    expect(editDistance(a, b)).toBe(distance);
    expect(editDistance(b, a)).toBe(distance);
  });
});

describe('closest', () => {
  const commands = ['status', 'discover', 'prepare', 'commit', 'up', 'down', 'demo'];

  test('the nearest candidate within one edit per three characters', () => {
    expect(closest('stauts', commands)).toBe('status');
    expect(closest('comit', commands)).toBe('commit');
    expect(closest('uo', commands)).toBe('up');
    expect(closest('confg', ['config', 'json', 'help'])).toBe('config');
  });

  test('nothing when no candidate is that close', () => {
    expect(closest('frobnicate', commands)).toBeUndefined();
    expect(closest('stop', commands)).toBeUndefined();
    expect(closest('xyz', commands)).toBeUndefined();
    expect(closest('status', [])).toBeUndefined();
  });

  test('a tie goes to the earlier candidate, a nearer one wins wherever it is', () => {
    expect(closest('cat', ['bat', 'cap'])).toBe('bat');
    expect(closest('cat', ['cap', 'bat'])).toBe('cap');
    expect(closest('cat', ['bat', 'cat'])).toBe('cat');
  });
});

test('didYouMean words a suggestion and is empty without one', () => {
  expect(didYouMean('status')).toBe(" (did you mean 'status'?)");
  expect(didYouMean(undefined)).toBe('');
});
