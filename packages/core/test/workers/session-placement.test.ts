import { oneCopyPerSession, placeSessions } from '../../src/workers/session-placement.js';

const OLD_A = 'aaaaaaaaaaaaaaaa';
const OLD_B = 'bbbbbbbbbbbbbbbb';
const OLD_C = 'cccccccccccccccc';
const W1 = { index: 1, routingId: '1111111111111111' };
const W2 = { index: 2, routingId: '2222222222222222' };
const W3 = { index: 3, routingId: '3333333333333333' };

const refs = (owner: string, n: number) =>
  Array.from({ length: n }, (_, i) => ({ id: `${owner.slice(0, 1)}${i}`, owner }));
const ids = (owner: string, n: number) => refs(owner, n).map((r) => r.id);

describe('placeSessions', () => {
  it('every record of one pre-crash owner goes to one live worker, aliased there', () => {
    const placed = placeSessions({ sessions: [...refs(OLD_A, 3), ...refs(OLD_B, 3)], owners: [] }, [
      W1,
      W2,
    ]);
    expect(placed.sessions.get(1)).toEqual(ids(OLD_A, 3));
    expect(placed.sessions.get(2)).toEqual(ids(OLD_B, 3));
    expect(placed.aliases).toEqual(
      new Map([
        [OLD_A, W1.routingId],
        [OLD_B, W2.routingId],
      ]),
    );
  });

  it('placement by load: the largest owner first, each to the worker with the fewest records', () => {
    const sessions = [...refs(OLD_B, 3), ...refs(OLD_A, 5), ...refs(OLD_C, 2)];
    const placed = placeSessions({ sessions, owners: [] }, [W1, W2]);
    // A (5) → 1; B (3) → 2; C (2) → 2 (3 records < 5).
    expect(placed.aliases.get(OLD_A)).toBe(W1.routingId);
    expect(placed.aliases.get(OLD_B)).toBe(W2.routingId);
    expect(placed.aliases.get(OLD_C)).toBe(W2.routingId);
    expect(placed.sessions.get(2)).toHaveLength(5);
  });

  it('equal records: the worker with fewer groups, then the lower index', () => {
    // Owners that exported nothing still get an alias: their cookies may still arrive.
    const placed = placeSessions({ sessions: [], owners: [OLD_C, OLD_A, OLD_B] }, [W2, W3, W1]);
    expect(placed.aliases).toEqual(
      new Map([
        [OLD_A, W1.routingId],
        [OLD_B, W2.routingId],
        [OLD_C, W3.routingId],
      ]),
    );
  });

  it('sessions that name no owner are placed one by one, in the placement table', () => {
    const placed = placeSessions(
      {
        sessions: [{ id: 'plain-1' }, { id: 'plain-2' }, { id: 'plain-3' }, ...refs(OLD_A, 2)],
        owners: [OLD_A],
      },
      [W1, W2],
    );
    expect(placed.aliases).toEqual(new Map([[OLD_A, W1.routingId]]));
    expect(placed.placements).toEqual(
      new Map([
        ['plain-1', W2.routingId],
        ['plain-2', W2.routingId],
        ['plain-3', W1.routingId],
      ]),
    );
    expect(placed.sessions.get(1)).toEqual([...ids(OLD_A, 2), 'plain-3']);
  });
});

describe('oneCopyPerSession', () => {
  it('one copy per session at export: the live copy wins, the unused restored copy is freed', () => {
    const restored = { worker: 1, sessionId: 's1', unused: true };
    const seededAgain = { worker: 2, sessionId: 's1', unused: false };
    const other = { worker: 1, sessionId: 's2', unused: true };
    const result = oneCopyPerSession([restored, seededAgain, other]);
    expect(result.kept).toEqual([seededAgain, other]);
    expect(result.stale).toEqual([restored]);
    expect(result.conflicts).toEqual([]);
  });

  it('two live copies keep one and report the session; none is freed', () => {
    const first = { worker: 1, sessionId: 's1', unused: false };
    const second = { worker: 2, sessionId: 's1', unused: false };
    expect(oneCopyPerSession([first, second])).toEqual({
      kept: [first],
      stale: [],
      conflicts: ['s1'],
    });
  });
});
