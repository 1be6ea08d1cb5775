import {
  failureTable,
  formatCounts,
  formatKeys,
  formatLease,
  formatSeconds,
  jsonDocument,
  table,
} from '../src/output.js';

describe('output', () => {
  test('table aligns columns and leaves no trailing spaces', () => {
    expect(
      table(
        ['SERVER', 'KIND', 'NOTE'],
        [
          ['env', 'environment', 'x'],
          ['policy-long', 'model', ''],
        ],
      ),
    ).toBe(
      ['SERVER       KIND         NOTE', 'env          environment  x', 'policy-long  model'].join(
        '\n',
      ),
    );
  });

  test('formatKeys cuts long lists and counts the rest', () => {
    expect(formatKeys([])).toBe('-');
    expect(formatKeys(['a', 'b'])).toBe('a,b');
    expect(formatKeys(['a', 'b', 'c', 'd'], 2)).toBe('a,b (+2 more)');
  });

  test('formatLease is the time left, or expired, or none', () => {
    expect(formatLease(null, 100)).toBe('-');
    expect(formatLease(160.4, 100)).toBe('60 s left');
    expect(formatLease(99, 100)).toBe('expired');
  });

  test('formatCounts and formatSeconds', () => {
    expect(formatCounts({ episodes: 3, parked: 1 })).toBe('episodes=3 parked=1');
    expect(formatCounts({})).toBe('-');
    expect(formatCounts(undefined)).toBe('-');
    expect(formatSeconds(0.12345)).toBe('0.123 s');
  });

  test('failureTable sorts by server', () => {
    expect(failureTable({ b: 'down', a: 'HTTP 409 invalid_phase' })).toBe(
      ['SERVER  ERROR', 'a       HTTP 409 invalid_phase', 'b       down'].join('\n'),
    );
  });

  test('jsonDocument is one JSON document led by command, ok and exit_code', () => {
    const text = jsonDocument('prepare', 3, { prepared: false });
    expect(text.endsWith('}\n')).toBe(true);
    expect(Object.entries(JSON.parse(text))).toEqual([
      ['command', 'prepare'],
      ['ok', false],
      ['exit_code', 3],
      ['prepared', false],
    ]);
  });
});
