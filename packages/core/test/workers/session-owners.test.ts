import {
  isRoutingId,
  newRoutingId,
  ownedName,
  parseOwnedName,
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
  it('the name a cookie signs carries the owner beside the session id, unchanged', () => {
    const owner = newRoutingId();
    expect(isRoutingId(owner)).toBe(true);
    const ref = { id: 'resources-session-0a1b', owner };
    expect(parseOwnedName(ownedName(ref))).toEqual(ref);
    // A session id with dots of its own survives.
    expect(parseOwnedName(ownedName({ id: 'a.b.c', owner }))).toEqual({ id: 'a.b.c', owner });
  });

  it("a single-process cookie's name is the session id alone: no owner", () => {
    const id = '6a1c1f0e-8d43-4a52-9b3f-1f1f1f1f1f1f';
    expect(ownedName({ id })).toBe(id);
    expect(parseOwnedName(id)).toEqual({ id });
    expect(parseOwnedName('ABCDEFABCDEFABCD.x')).toEqual({ id: 'ABCDEFABCDEFABCD.x' });
  });

  it('each worker gets its own routing id', () => {
    expect(newRoutingId()).not.toBe(newRoutingId());
  });
});

describe('sessionTarget', () => {
  it('serves its own sessions and requests without a session locally', () => {
    expect(sessionTarget({ id: 's1', owner: SELF }, tables())).toBeUndefined();
    expect(sessionTarget(undefined, tables())).toBeUndefined();
  });

  it("forwards another live worker's session to that worker", () => {
    expect(sessionTarget({ id: 's1', owner: OTHER }, tables())).toBe(OTHER);
  });

  it('alias routing: a cookie naming a worker that no longer exists reaches the new owner', () => {
    const aliases = new Map([[DEAD, OTHER]]);
    expect(sessionTarget({ id: 's1', owner: DEAD }, tables({ aliases }))).toBe(OTHER);
    // Aliased to this worker: served here.
    const toSelf = tables({ aliases: new Map([[DEAD, SELF]]) });
    expect(sessionTarget({ id: 's1', owner: DEAD }, toSelf)).toBeUndefined();
  });

  it('placement-table routing: a session without an owner goes where the restore placed it', () => {
    const placements = new Map([['plain-session', OTHER]]);
    expect(sessionTarget({ id: 'plain-session' }, tables({ placements }))).toBe(OTHER);
    expect(sessionTarget({ id: 'another-plain' }, tables({ placements }))).toBeUndefined();
    // A placement never overrides the owner a cookie names.
    const named = tables({ placements: new Map([['x', OTHER]]) });
    expect(sessionTarget({ id: 'x', owner: SELF }, named)).toBeUndefined();
  });

  it('an owner found gone is unresolvable: served here, as a new session would be', () => {
    const gone = new Set([DEAD]);
    expect(sessionTarget({ id: 's1', owner: DEAD }, tables({ gone }))).toBeUndefined();
    const aliases = new Map([[DEAD, OTHER]]);
    const aliasGone = tables({ aliases, gone: new Set([OTHER]) });
    expect(sessionTarget({ id: 's1', owner: DEAD }, aliasGone)).toBeUndefined();
  });
});
