import { until, Gate } from '@ckpt-gym/testing';
import { jest } from '@jest/globals';

import { SessionTable } from '../src/index.js';
import { probeServer } from './probe.js';
import { cleanUp, episodeJson, startServer, tempDir, type TestServer, track } from './support.js';

afterEach(async () => {
  jest.restoreAllMocks();
  await cleanUp();
});

const soon = (): number => Date.now() / 1000 + 30;
/** A deadline close enough that a retire waiting on a gate is cut short by it. */
const shortly = (): number => Date.now() / 1000 + 0.3;

let ids = 0;
const id = (): string => `op-${++ids}`;

function retire(server: TestServer, keys: string[], deadline = soon()) {
  return server.control('retire', {
    checkpoint_id: id(),
    deadline_ts: deadline,
    episode_ids: keys.map(episodeJson),
  });
}

function forget(server: TestServer, rollouts: string[]) {
  return server.control('forget', {
    checkpoint_id: id(),
    deadline_ts: soon(),
    rollout_ids: rollouts,
  });
}

async function prepare(server: TestServer, checkpointId: string, deadline = soon()) {
  return (await server.control('prepare', { checkpoint_id: checkpointId, deadline_ts: deadline }))
    .body as { phase: string; report: { blockers: string[]; ready: boolean } };
}

const sessions = (server: TestServer) => server.participant.readiness().counts.sessions;
const past = (): number => Date.now() / 1000 - 1;
/** A deadline just ahead: prepare answers almost at once with the current report (a passed one is refused). */
const brief = (): number => Date.now() / 1000 + 0.05;

describe('retire', () => {
  test.each(['exported', 'stateless', 'restart_only'] as const)(
    "a retire waits for the session's request in flight, refuses a new one meanwhile, then frees it through retireSessionState (%s)",
    async (mode) => {
      const probe = probeServer(mode);
      const server = await startServer(probe);
      const cookie = await server.seed('r1');
      probe.gates.tool = new Gate();
      const call = track(server.post('/bump', {}, { cookie, key: 'r1' }));
      await until(() => probe.calls.tool === 1, 'the tool to run');
      const retiring = track(retire(server, ['r1']));
      await until(
        () => server.participant.isOpen([...probe.values.keys()][0] as string) === false,
        'the fence',
      );
      const refused = await server.post('/bump', {}, { cookie, key: 'r1' });
      const cookieOnly = await server.post('/bump', {}, { cookie });
      expect(refused.body.error).toMatchObject({ code: 'stale_attempt' });
      expect(cookieOnly.body.error).toMatchObject({ code: 'stale_attempt' });
      expect(retiring.done).toBe(false);
      expect(probe.calls.retired).toEqual([]);
      probe.gates.tool.open();
      expect((await call.promise).status).toBe(200);
      expect((await retiring.promise).body).toEqual({ retired_count: 1 });
      expect(probe.calls.retired).toHaveLength(1);
      expect(sessions(server)).toBe(0);
    },
  );

  test('a late seed of a retired attempt is refused until forget, after which the rollout can seed again', async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    await server.seed('r1');
    expect((await retire(server, ['r1'])).status).toBe(200);
    const late = await server.post('/seed_session', {}, { key: 'r1' });
    expect(late.body.error).toMatchObject({ code: 'stale_attempt' });
    expect((await server.control('status')).body.retired_sessions).toBe(1);
    expect((await forget(server, ['r1'])).body).toEqual({ forgotten_count: 1 });
    expect((await server.control('status')).body.retired_sessions).toBe(0);
    expect((await server.post('/seed_session', {}, { key: 'r1' })).status).toBe(200);
  });

  test("a retire that arrives after its deadline still fences the attempt's sessions", async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    const cookie = await server.seed('r1');
    // The freeing hook hangs, so only the mark can be what refuses the session below.
    probe.gates.retire = new Gate();
    const late = await retire(server, ['r1'], past());
    expect(late.body.error).toMatchObject({ code: 'deadline_exceeded' });
    expect((await server.post('/bump', {}, { cookie, key: 'r1' })).body.error).toMatchObject({
      code: 'stale_attempt',
    });
    expect((await server.post('/bump', {}, { cookie })).body.error).toMatchObject({
      code: 'stale_attempt',
    });
    expect(probe.calls.tool).toBe(0);
    const blocked = await prepare(server, 'c1', brief());
    expect(blocked.report.blockers).toEqual(['r1']);
    await server.ok('resume', { checkpoint_id: 'c1' });
    expect((await forget(server, ['r1'])).body.error).toMatchObject({ code: 'retire_incomplete' });
    probe.gates.retire.open();
    expect((await retire(server, ['r1'])).status).toBe(200);
    expect(sessions(server)).toBe(0);
    expect((await forget(server, ['r1'])).status).toBe(200);
  });

  test("a session whose retire was cut short in the server's hook stays until a retry frees it, and blocks prepare meanwhile", async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    await server.seed('r1');
    probe.gates.retire = new Gate();
    const cut = await retire(server, ['r1'], shortly());
    expect(cut.body.error).toMatchObject({ code: 'deadline_exceeded' });
    expect(sessions(server)).toBe(1);
    const blocked = await prepare(server, 'c1', brief());
    expect(blocked.report).toMatchObject({ ready: false, blockers: ['r1'] });
    const committed = await server.control('commit', {
      checkpoint_id: 'c1',
      deadline_ts: soon(),
      checkpoint_dir: await tempDir(),
      episode_ids: null,
    });
    expect(committed.status).toBe(409);
    await server.ok('resume', { checkpoint_id: 'c1' });
    expect((await forget(server, ['r1'])).body.error).toMatchObject({ code: 'retire_incomplete' });
    probe.gates.retire.open();
    expect((await retire(server, ['r1'])).status).toBe(200);
    expect(sessions(server)).toBe(0);
    expect((await forget(server, ['r1'])).status).toBe(200);
  });

  test('a close from the owning retired attempt still goes through and frees its session', async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    const cookie = await server.seed('r1');
    probe.gates.retire = new Gate();
    await retire(server, ['r1'], past());
    const close = await server.post('/close_session', {}, { cookie, key: 'r1' });
    expect(close.status).toBe(200);
    expect(sessions(server)).toBe(0);
    expect((await forget(server, ['r1'])).status).toBe(200);
  });

  test('a retire waits for an admitted seed of its attempt and frees the session it creates', async () => {
    const probe = probeServer();
    probe.replaceIdWith = 'seeded';
    const server = await startServer(probe);
    probe.gates.seed = new Gate();
    const seed = track(server.post('/seed_session', {}, { key: 'r1' }));
    await until(() => probe.calls.seed === 1, 'the seed to run');
    const retiring = track(retire(server, ['r1']));
    await new Promise((resolve) => setTimeout(resolve, 20));
    expect(retiring.done).toBe(false);
    probe.gates.seed.open();
    await seed.promise;
    expect((await retiring.promise).status).toBe(200);
    expect(probe.calls.retired).toEqual(['seeded']);
    expect(sessions(server)).toBe(0);
  });

  test("a retire cut short while a seed is in flight still fences the attempt's existing session, and the seed leaves a retired session", async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    const existing = await server.seed('r1');
    probe.replaceIdWith = 'late';
    probe.gates.seed = new Gate();
    const seed = track(server.post('/seed_session', {}, { key: 'r1' }));
    await until(() => probe.calls.seed === 2, 'the second seed to run');
    const cut = await retire(server, ['r1'], shortly());
    expect(cut.body.error).toMatchObject({ code: 'deadline_exceeded' });
    // Cookie only: nothing but the fence at mark time can refuse it (the retire waits on the seed).
    expect((await server.post('/bump', {}, { cookie: existing })).body.error).toMatchObject({
      code: 'stale_attempt',
    });
    expect(server.participant.ready()).toBe(false);
    // forget is refused while a seed of the retired attempt is in flight.
    expect((await forget(server, ['r1'])).body.error).toMatchObject({ code: 'retire_incomplete' });
    probe.gates.seed.open();
    const seeded = await seed.promise;
    const lateCookie = seeded.setCookie as string;
    // The session the seed created is retired at once: refused, not exported, blocks forget.
    expect((await server.post('/bump', {}, { cookie: lateCookie })).body.error).toMatchObject({
      code: 'stale_attempt',
    });
    expect(server.participant.isOpen('late')).toBe(false);
    await until(() => probe.calls.retired.includes('late') || sessions(server) === 2, 'settle');
    probe.gates.retire = undefined;
    expect((await retire(server, ['r1'])).status).toBe(200);
    expect(sessions(server)).toBe(0);
    expect((await forget(server, ['r1'])).status).toBe(200);
  });

  test('a seed that finishes after its retire was cut short is not exported and forget waits for a retried retire', async () => {
    const probe = probeServer();
    probe.replaceIdWith = 'late';
    const server = await startServer(probe);
    probe.gates.seed = new Gate();
    probe.gates.retire = new Gate();
    const seed = track(server.post('/seed_session', {}, { key: 'r1' }));
    await until(() => probe.calls.seed === 1, 'the seed to run');
    const retiring = retire(server, ['r1'], shortly());
    probe.gates.seed.open();
    await seed.promise;
    expect((await retiring).body.error).toMatchObject({ code: 'deadline_exceeded' });
    expect(sessions(server)).toBe(1);
    expect((await forget(server, ['r1'])).body.error).toMatchObject({ code: 'retire_incomplete' });
    const blocked = await prepare(server, 'c1', brief());
    expect(blocked.report.blockers).toEqual(['r1']);
    await server.ok('resume', { checkpoint_id: 'c1' });
    probe.gates.retire.open();
    expect((await retire(server, ['r1'])).status).toBe(200);
    expect((await forget(server, ['r1'])).status).toBe(200);
  });

  test('marking an attempt retired fences its sessions at once, before any retire runs', async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    const cookie = await server.seed('r1');
    // What the control plane does first on a retire or restore; here nothing else follows.
    server.participant.marks.mark([episodeJson('r1') as never]);
    expect((await server.post('/bump', {}, { cookie })).body.error).toMatchObject({
      code: 'stale_attempt',
    });
    expect(probe.calls.tool).toBe(0);
    expect(server.participant.ready()).toBe(false);
    expect(await server.participant.export(null, new AbortController().signal)).toEqual([]);
    expect((await server.control('status')).body.retired_sessions).toBe(1);
  });

  test('a seed that finishes after its attempt was only marked leaves a retired session', async () => {
    const probe = probeServer();
    probe.replaceIdWith = 'late';
    const server = await startServer(probe);
    probe.gates.seed = new Gate();
    const seed = track(server.post('/seed_session', {}, { key: 'r1' }));
    await until(() => probe.calls.seed === 1, 'the seed to run');
    server.participant.marks.mark([episodeJson('r1') as never]);
    probe.gates.seed.open();
    const cookie = (await seed.promise).setCookie as string;
    expect(server.participant.isOpen('late')).toBe(false);
    expect(server.participant.ready()).toBe(false);
    expect((await server.post('/bump', {}, { cookie })).body.error).toMatchObject({
      code: 'stale_attempt',
    });
    expect((await forget(server, ['r1'])).body.error).toMatchObject({ code: 'retire_incomplete' });
    expect((await retire(server, ['r1'])).status).toBe(200);
    expect((await forget(server, ['r1'])).status).toBe(200);
  });

  test('forget is refused with retire_incomplete while a seed of a retired attempt is in flight, and the session it creates is refused afterwards', async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    probe.gates.seed = new Gate();
    const seed = track(server.post('/seed_session', {}, { key: 'r1' }));
    await until(() => probe.calls.seed === 1, 'the seed to run');
    expect((await retire(server, ['r1'], shortly())).body.error).toMatchObject({
      code: 'deadline_exceeded',
    });
    expect(server.participant.readiness().counts.sessions).toBe(0);
    expect((await forget(server, ['r1'])).body.error).toMatchObject({ code: 'retire_incomplete' });
    probe.gates.seed.open();
    const cookie = (await seed.promise).setCookie as string;
    expect((await server.post('/bump', {}, { cookie })).body.error).toMatchObject({
      code: 'stale_attempt',
    });
    expect(probe.calls.tool).toBe(0);
  });

  test('retiring one rollout does not scan every session, and ready() does not list blockers', async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    for (let i = 0; i < 20; i += 1) await server.seed(`r${i}`);
    const scan = jest.spyOn(SessionTable.prototype, 'all').mockImplementation(() => {
      throw new Error('scanned every session');
    });
    const readiness = jest.spyOn(server.participant, 'readiness');
    expect((await retire(server, ['r3'])).status).toBe(200);
    expect(server.participant.ready()).toBe(true);
    expect(scan).not.toHaveBeenCalled();
    expect(readiness).not.toHaveBeenCalled();
    expect(sessions(server)).toBe(19);
  });
});
