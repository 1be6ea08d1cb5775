import {
  isRoutingId,
  newRoutingId,
  ownedSessionId,
  ownerOf,
  type RoutingTables,
  sessionTarget,
} from '../../src/workers/session-owners.js';

const SELF = 'aaaaaaaaaaaaaaaa';
const OTHER = 'bbbbbbbbbbbbbbbb';
const DEAD = 'cccccccccccccccc';

function tables(parts: Partial<RoutingTables> = {}): RoutingTables {
  return {
    self: SELF,
    aliases: new Map(),
    placements: new Map(),
    gone: new Set(),
    ...parts,
  };
}

describe('session owners', () => {
  it('a session id created on a worker names that worker', () => {
    const owner = newRoutingId();
    expect(isRoutingId(owner)).toBe(true);
    expect(ownerOf(ownedSessionId(owner, 'local-1'))).toBe(owner);
  });

  it('a single-process id names no owner', () => {
    expect(ownedSessionId(undefined, '6a1c1f0e-8d43-4a52-9b3f-1f1f1f1f1f1f')).toBe(
      '6a1c1f0e-8d43-4a52-9b3f-1f1f1f1f1f1f',
    );
    expect(ownerOf('6a1c1f0e-8d43-4a52-9b3f-1f1f1f1f1f1f')).toBeUndefined();
    expect(ownerOf('ABCDEFABCDEFABCD.x')).toBeUndefined();
  });

  it('each worker gets its own routing id', () => {
    expect(newRoutingId()).not.toBe(newRoutingId());
  });
});

describe('sessionTarget', () => {
  it('serves its own sessions and requests without a session locally', () => {
    expect(sessionTarget(`${SELF}.s1`, tables())).toBeUndefined();
    expect(sessionTarget(undefined, tables())).toBeUndefined();
  });

  it("forwards another live worker's session to that worker", () => {
    expect(sessionTarget(`${OTHER}.s1`, tables())).toBe(OTHER);
  });

  it('alias routing: a cookie naming a worker that no longer exists reaches the new owner', () => {
    const aliases = new Map([[DEAD, OTHER]]);
    expect(sessionTarget(`${DEAD}.s1`, tables({ aliases }))).toBe(OTHER);
    // Aliased to this worker: served here.
    expect(sessionTarget(`${DEAD}.s1`, tables({ aliases: new Map([[DEAD, SELF]]) }))).toBe(
      undefined,
    );
  });

  it('placement-table routing: a session without an owner goes where the restore placed it', () => {
    const placements = new Map([['plain-session', OTHER]]);
    expect(sessionTarget('plain-session', tables({ placements }))).toBe(OTHER);
    expect(sessionTarget('another-plain', tables({ placements }))).toBeUndefined();
    // A placement never overrides the owner an id names.
    expect(
      sessionTarget(`${SELF}.x`, tables({ placements: new Map([[`${SELF}.x`, OTHER]]) })),
    ).toBeUndefined();
  });

  it('an owner found gone is unresolvable: served here, as a new session would be', () => {
    expect(sessionTarget(`${DEAD}.s1`, tables({ gone: new Set([DEAD]) }))).toBeUndefined();
    const aliases = new Map([[DEAD, OTHER]]);
    expect(sessionTarget(`${DEAD}.s1`, tables({ aliases, gone: new Set([OTHER]) }))).toBe(
      undefined,
    );
  });
});
