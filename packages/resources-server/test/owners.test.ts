import type { IncomingMessage } from 'node:http';

import { captureKey } from '@ckpt-gym/core/protocol';
import { ep } from '@ckpt-gym/testing';

import {
  counterServer,
  McpTokens,
  ResourcesParticipant,
  type ResourcesSessionRecord,
  SessionCookie,
} from '../src/index.js';
import { checkDefinition } from '../src/definition.js';
import { resourcesSessionOf } from '../src/routing.js';

const OWNER = '0123456789abcdef';
const OLD_OWNER = 'fedcba9876543210';
const secret = Buffer.from('owners-test');

function requestWith(url: string, headers: Record<string, string>): IncomingMessage {
  return { url, headers } as unknown as IncomingMessage;
}

describe('the owner a client keeps', () => {
  it("a worker's cookie names it beside the session id; one process's names none", () => {
    const worker = new SessionCookie('res', secret, OWNER);
    const single = new SessionCookie('res', secret);
    const header = (c: SessionCookie) => c.header('resources-session-1').split(';')[0]!;
    expect(single.readRef(header(worker))).toEqual({ id: 'resources-session-1', owner: OWNER });
    // Either reads the other's cookie, and both agree on the session id.
    expect(worker.read(header(worker))).toBe('resources-session-1');
    expect(worker.readRef(header(single))).toEqual({ id: 'resources-session-1' });
  });

  it("a worker's MCP token names it; the router reads it on /mcp, the cookie elsewhere", () => {
    const tokens = new McpTokens(secret, OWNER);
    const token = tokens.mint('s-mcp', ['get_counter_value'], ep('r-0'));
    expect(new McpTokens(secret).read(`Bearer ${token}`).owner).toBe(OWNER);
    const cookie = new SessionCookie('res', secret, OLD_OWNER);
    const sessionOf = resourcesSessionOf(cookie, tokens);
    const cookieHeader = cookie.header('s-cookie').split(';')[0]!;
    const both = { authorization: `Bearer ${token}`, cookie: cookieHeader };
    expect(sessionOf(requestWith('/mcp', both))).toEqual({ id: 's-mcp', owner: OWNER });
    expect(sessionOf(requestWith('/get_counter_value', both))).toEqual({
      id: 's-cookie',
      owner: OLD_OWNER,
    });
    expect(sessionOf(requestWith('/mcp', { authorization: 'Bearer forged.x' }))).toBeUndefined();
  });
});

describe('records name the owner their cookie names', () => {
  const declarations = checkDefinition(counterServer());
  const record = (owner?: string): ResourcesSessionRecord => ({
    episode_id: ep('r-0'),
    session_id: 's-0',
    ...(owner ? { owner } : {}),
    state: { count: 4 },
  });

  it('a restored session keeps the owner its record names; a new one names this worker', async () => {
    const participant = new ResourcesParticipant('res', declarations, { owner: OWNER });
    await participant.install([record(OLD_OWNER)], [ep('r-0-a1')]);
    expect(participant.ownerOf('s-0')).toBe(OLD_OWNER);
    expect(participant.ownerOf('seeded-here')).toBe(OWNER);
    const [exported] = await participant.export(null, new AbortController().signal);
    expect(exported).toMatchObject({ session_id: 's-0', owner: OLD_OWNER });
    expect(captureKey(exported!.episode_id)).toBe('r-0-a1');
  });

  it('a session checkpointed by one process names no owner after a restore', async () => {
    const participant = new ResourcesParticipant('res', declarations, { owner: OWNER });
    await participant.install([record()], [ep('r-0-a1')]);
    const [exported] = await participant.export(null, new AbortController().signal);
    expect(exported).not.toHaveProperty('owner');
  });

  it('refuses a record whose owner is not a routing id', () => {
    const participant = new ResourcesParticipant('res', declarations);
    expect(() =>
      participant.validateRecord({ ...record(), owner: 'not-an-id' } as never, 'r-0'),
    ).toThrow('owner must be a routing id');
  });

  it('lists its copies, and frees an unused restored copy only', async () => {
    const participant = new ResourcesParticipant('res', declarations, { owner: OWNER });
    await participant.install([record(OLD_OWNER)], [ep('r-0-a1')]);
    expect(participant.sessionCopies()).toEqual([{ id: 's-0', unused: true }]);
    await participant.freeUnused(['s-0', 'not-held']);
    expect(participant.sessionCopies()).toEqual([]);
    expect(participant.restoredPending()).toEqual([]);
  });
});
