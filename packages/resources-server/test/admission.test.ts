import { until, Gate } from '@ckpt-gym/testing';
import { probeServer } from './probe.js';
import { cleanUp, episodeJson, startServer, tempDir, type TestServer, track } from './support.js';

afterEach(cleanUp);

const soon = (): number => Date.now() / 1000 + 30;
/** A deadline just ahead: prepare answers almost at once with the current report (a passed one is refused). */
const brief = (): number => Date.now() / 1000 + 0.05;

async function prepare(server: TestServer, id: string, deadline = soon(), restarts?: string[]) {
  const reply = await server.control('prepare', {
    checkpoint_id: id,
    deadline_ts: deadline,
    ...(restarts ? { restarts } : {}),
  });
  expect(reply.status).toBe(200);
  return reply.body as {
    phase: string;
    report: { blockers: string[]; restarts: string[]; ready: boolean };
  };
}

async function commit(server: TestServer, id: string, keys: string[] | null) {
  return server.control('commit', {
    checkpoint_id: id,
    deadline_ts: soon(),
    checkpoint_dir: await tempDir(),
    episode_ids: keys === null ? null : keys.map(episodeJson),
  });
}

const resume = (server: TestServer, id: string) => server.ok('resume', { checkpoint_id: id });
const waiting = (server: TestServer) => server.participant.readiness().counts.waiting;

describe('the rollout prefix', () => {
  test.each(['/seed_session', '/reset'])(
    'a session start without a rollout prefix is refused before its handler runs (%s)',
    async (path) => {
      const probe = probeServer();
      const server = await startServer(probe);
      const reply = await server.post(path, {});
      expect(reply.status).toBe(400);
      expect(reply.body.error).toMatchObject({ code: 'rollout_id_required' });
      expect([probe.calls.seed, probe.calls.reset]).toEqual([0, 0]);
      expect(probe.values.size).toBe(0);
    },
  );

  test.each(['/close_session', '/verify'])(
    'a session end without a rollout prefix is refused before its handler runs (%s)',
    async (path) => {
      const probe = probeServer();
      const server = await startServer(probe);
      const cookie = await server.seed('r1');
      const reply = await server.post(path, {}, { cookie });
      expect(reply.status).toBe(400);
      expect(reply.body.error).toMatchObject({ code: 'rollout_id_required' });
      expect([probe.calls.close, probe.calls.verify]).toEqual([0, 0]);
      expect(server.participant.readiness().counts.sessions).toBe(1);
    },
  );

  test('a tool call with only the cookie on a session seeded in this process is admitted', async () => {
    const server = await startServer(probeServer());
    const cookie = await server.seed('r1');
    expect((await server.post('/bump', {}, { cookie })).body).toEqual({ value: 1 });
  });

  test('a request on a session from another rollout is refused with stale_attempt', async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    const cookie = await server.seed('r1');
    const reply = await server.post('/bump', {}, { cookie, key: 'r2' });
    expect(reply.status).toBe(409);
    expect(reply.body.error).toMatchObject({ code: 'stale_attempt' });
    expect(probe.calls.tool).toBe(0);
  });
});

describe('seed reply headers and status', () => {
  test.each([
    ['exported', 'wait', null],
    ['stateless', 'replay', null],
    ['restart_only', 'wait', '1'],
  ] as const)(
    'a %s server with %s verification declares it on every session start reply',
    async (mode, verify, restart) => {
      const server = await startServer(probeServer(mode, verify));
      for (const path of ['/seed_session', '/reset']) {
        const reply = await server.post(path, {}, { key: 'r1' });
        expect(reply.headers.get('x-ng-checkpoint-verify')).toBe(verify);
        expect(reply.headers.get('x-ng-checkpoint-restart')).toBe(restart);
      }
      const tool = await server.post('/bump', {}, { key: 'r1' });
      expect(tool.headers.get('x-ng-checkpoint-verify')).toBeNull();
    },
  );

  test('status reports mode, verify and retired_sessions', async () => {
    const server = await startServer(probeServer('stateless', 'replay'));
    const status = await server.control('status');
    expect(status.body).toMatchObject({
      kind: 'resources',
      instance: 'res',
      mode: 'stateless',
      verify: 'replay',
      retired_sessions: 0,
    });
  });
});

describe('requests during a checkpoint', () => {
  test('a seed arriving during an open checkpoint waits for resume', async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    await prepare(server, 'c1');
    const seed = track(server.post('/seed_session', {}, { key: 'r1' }));
    await until(() => waiting(server) === 1, 'the seed to wait');
    expect(probe.calls.seed).toBe(0);
    expect(seed.done).toBe(false);
    await resume(server, 'c1');
    expect((await seed.promise).status).toBe(200);
    expect(probe.calls.seed).toBe(1);
  });

  test('a seed in flight when admission closes holds up prepare and is exported', async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    probe.gates.seed = new Gate();
    const seed = track(server.post('/seed_session', {}, { key: 'r1' }));
    await until(() => probe.calls.seed === 1, 'the seed handler to run');
    const first = await prepare(server, 'c1', brief());
    expect(first.phase).toBe('preparing');
    expect(first.report.blockers).toEqual(['r1']);
    probe.gates.seed.open();
    expect((await seed.promise).status).toBe(200);
    expect((await prepare(server, 'c1')).phase).toBe('prepared');
    const committed = await commit(server, 'c1', ['r1']);
    expect(committed.body.episode_ids).toEqual(['r1']);
  });

  test('in restart_only mode a seed in flight when admission closes is reported as a restart, its reply says restart, and the commit of the rest succeeds', async () => {
    const probe = probeServer('restart_only');
    const server = await startServer(probe);
    probe.gates.seed = new Gate();
    const seed = track(server.post('/seed_session', {}, { key: 'r1' }));
    await until(() => probe.calls.seed === 1, 'the seed handler to run');
    const prepared = await prepare(server, 'c1');
    expect(prepared.phase).toBe('prepared');
    expect(prepared.report.restarts).toEqual(['r1']);
    const inScope = await commit(server, 'c1', ['r1', 'r2']);
    expect(inScope.body.error).toMatchObject({ code: 'restart_in_scope' });
    expect((await commit(server, 'c1', ['r2'])).status).toBe(200);
    probe.gates.seed.open();
    const reply = await seed.promise;
    expect(reply.headers.get('x-ng-checkpoint-restart')).toBe('1');
    await resume(server, 'c1');
  });

  test('in restart_only mode a seed waiting for resume waits again when a new checkpoint closes admission before it runs', async () => {
    const probe = probeServer('restart_only');
    const server = await startServer(probe);
    await prepare(server, 'c1');
    const seed = track(server.post('/seed_session', {}, { key: 'r1' }));
    await until(() => waiting(server) === 1, 'the seed to wait');
    // Reopen and close again before the waiting seed runs.
    const participant = server.participant;
    void participant.openAdmission();
    void participant.closeAdmission({
      checkpointId: 'c2',
      deadlineTs: soon(),
      carriedRestarts: new Set(),
    });
    await new Promise((resolve) => setTimeout(resolve, 20));
    expect(probe.calls.seed).toBe(0);
    expect(waiting(server)).toBe(1);
    await participant.openAdmission();
    expect((await seed.promise).status).toBe(200);
  });

  test('in restart_only mode other requests keep running through a checkpoint', async () => {
    const server = await startServer(probeServer('restart_only'));
    const cookie = await server.seed('r1');
    await prepare(server, 'c1');
    expect((await server.post('/bump', {}, { cookie, key: 'r1' })).body).toEqual({ value: 1 });
    expect((await server.post('/close_session', {}, { cookie, key: 'r1' })).status).toBe(200);
  });

  test('a tool call during a checkpoint waits for resume and the checkpoint holds the state from before it', async () => {
    const probe = probeServer('exported');
    const server = await startServer(probe);
    const cookie = await server.seed('r1');
    await prepare(server, 'c1');
    const call = track(server.post('/bump', {}, { cookie, key: 'r1' }));
    await until(() => waiting(server) === 1, 'the call to wait');
    expect((await commit(server, 'c1', ['r1'])).status).toBe(200);
    expect(probe.calls.exported).toEqual([[expect.any(String)]]);
    expect(call.done).toBe(false);
    await resume(server, 'c1');
    expect((await call.promise).body).toEqual({ value: 1 });
  });

  test('a tool call in flight holds up prepare', async () => {
    const probe = probeServer('stateless');
    const server = await startServer(probe);
    const cookie = await server.seed('r1');
    probe.gates.tool = new Gate();
    const call = track(server.post('/bump', {}, { cookie, key: 'r1' }));
    await until(() => probe.calls.tool === 1, 'the tool to run');
    expect((await prepare(server, 'c1', brief())).report.blockers).toEqual(['r1']);
    probe.gates.tool.open();
    await call.promise;
    expect((await prepare(server, 'c1')).phase).toBe('prepared');
  });

  test('a /close_session during a checkpoint waits for resume, then ends the session', async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    const cookie = await server.seed('r1');
    await prepare(server, 'c1');
    const close = track(server.post('/close_session', {}, { cookie, key: 'r1' }));
    await until(() => waiting(server) === 1, 'the close to wait');
    expect(probe.calls.close).toBe(0);
    await resume(server, 'c1');
    expect((await close.promise).status).toBe(200);
    expect(server.participant.readiness().counts.sessions).toBe(0);
  });

  test('a replayable /verify is admitted at once during a checkpoint and does not hold up prepare', async () => {
    const probe = probeServer('exported', 'replay');
    const server = await startServer(probe);
    const cookie = await server.seed('r1');
    probe.gates.verify = new Gate();
    const verify = track(server.post('/verify', {}, { cookie, key: 'r1' }));
    await until(() => probe.calls.verify === 1, 'verify to run');
    expect((await prepare(server, 'c1')).phase).toBe('prepared');
    const late = track(server.post('/verify', {}, { cookie, key: 'r1' }));
    await until(() => probe.calls.verify === 2, 'the second verify to run');
    probe.gates.verify.open();
    await Promise.all([verify.promise, late.promise]);
    await resume(server, 'c1');
  });

  test('a wait-mode /verify in flight holds up prepare, and one arriving during a checkpoint waits', async () => {
    const probe = probeServer('exported', 'wait');
    const server = await startServer(probe);
    const cookie = await server.seed('r1');
    const other = await server.seed('r2');
    probe.gates.verify = new Gate();
    const verify = track(server.post('/verify', {}, { cookie, key: 'r1' }));
    await until(() => probe.calls.verify === 1, 'verify to run');
    expect((await prepare(server, 'c1', brief())).report.blockers).toEqual(['r1']);
    probe.gates.verify.open();
    await verify.promise;
    expect((await prepare(server, 'c1')).phase).toBe('prepared');
    const late = track(server.post('/verify', {}, { cookie: other, key: 'r2' }));
    await until(() => waiting(server) === 1, 'the late verify to wait');
    expect(probe.calls.verify).toBe(1);
    await resume(server, 'c1');
    expect((await late.promise).status).toBe(200);
  });

  test.each(['exported', 'stateless', 'restart_only'] as const)(
    'a declared session start during an open checkpoint waits for resume and the commit has no record for it (%s)',
    async (mode) => {
      const probe = probeServer(mode);
      const server = await startServer(probe);
      await prepare(server, 'c1');
      const reset = track(server.post('/reset', {}, { key: 'r1' }));
      await until(() => waiting(server) === 1, 'the reset to wait');
      const committed = await commit(server, 'c1', null);
      expect(committed.body.episode_ids).toEqual([]);
      expect(probe.calls.reset).toBe(0);
      await resume(server, 'c1');
      expect((await reset.promise).status).toBe(200);
    },
  );

  test('a restart_only declared session start in flight is reported as a restart', async () => {
    const probe = probeServer('restart_only');
    const server = await startServer(probe);
    await server.seed('r0');
    probe.gates.seed = new Gate();
    const reset = track(server.post('/reset', {}, { key: 'r1' }));
    await until(() => probe.calls.reset === 1, 'the reset to run');
    const prepared = await prepare(server, 'c1');
    expect(prepared.phase).toBe('prepared');
    expect(prepared.report.restarts).toEqual(['r0', 'r1']);
    probe.gates.seed.open();
    expect((await reset.promise).headers.get('x-ng-checkpoint-restart')).toBe('1');
    await resume(server, 'c1');
  });

  test('a request in flight for a restart an earlier stage reported does not hold up prepare', async () => {
    const probe = probeServer('stateless');
    const server = await startServer(probe);
    const cookie = await server.seed('r1');
    probe.gates.tool = new Gate();
    const call = track(server.post('/bump', {}, { cookie, key: 'r1' }));
    await until(() => probe.calls.tool === 1, 'the tool to run');
    expect((await prepare(server, 'c1', soon(), ['r1'])).phase).toBe('prepared');
    const committed = await commit(server, 'c1', null);
    expect(committed.body.episode_ids).toEqual([]);
    await resume(server, 'c1');
    // Carried restarts end with the checkpoint: the same call now holds up the next one.
    expect((await prepare(server, 'c2', brief())).report.blockers).toEqual(['r1']);
    probe.gates.tool.open();
    await call.promise;
    await resume(server, 'c2');
  });

  test('a waiting request whose client goes away is no longer counted', async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    await prepare(server, 'c1');
    const abort = new AbortController();
    const seed = server.post('/seed_session', {}, { key: 'r1', signal: abort.signal });
    await until(() => waiting(server) === 1, 'the seed to wait');
    abort.abort();
    await expect(seed).rejects.toThrow();
    await until(() => waiting(server) === 0, 'the wait to end');
    await resume(server, 'c1');
    expect(probe.calls.seed).toBe(0);
    // A client going away is not a server error.
    expect(server.logger.lines.filter((line) => line.level === 'error')).toEqual([]);
  });
});

describe('session lifecycle', () => {
  test('a session whose ID the seed replaces is tracked under its new ID', async () => {
    const probe = probeServer();
    probe.replaceIdWith = 'chosen';
    const server = await startServer(probe);
    const cookie = await server.seed('r1');
    expect(server.participant.isOpen('chosen')).toBe(true);
    expect((await server.post('/bump', {}, { cookie, key: 'r1' })).body).toEqual({ value: 1 });
    expect(probe.values.get('chosen')).toBe(1);
  });

  test('a seed whose client went away after its handler started is still tracked', async () => {
    const probe = probeServer();
    probe.replaceIdWith = 'kept';
    probe.gates.seed = new Gate();
    const server = await startServer(probe);
    const abort = new AbortController();
    const seed = server.post('/seed_session', {}, { key: 'r1', signal: abort.signal });
    await until(() => probe.calls.seed === 1, 'the seed handler to run');
    abort.abort();
    await expect(seed).rejects.toThrow();
    probe.gates.seed.open();
    await until(() => server.participant.isOpen('kept'), 'the seed to be tracked');
    await until(() => server.participant.readiness().counts.inflight === 0, 'release');
  });

  test('a verify whose client went away after its handler started still ends the session', async () => {
    const probe = probeServer();
    probe.replaceIdWith = 'ending';
    const server = await startServer(probe);
    const cookie = await server.seed('r1');
    probe.gates.verify = new Gate();
    const abort = new AbortController();
    const verify = server.post('/verify', {}, { cookie, key: 'r1', signal: abort.signal });
    await until(() => probe.calls.verify === 1, 'the verify handler to run');
    abort.abort();
    await expect(verify).rejects.toThrow();
    probe.gates.verify.open();
    await until(() => !server.participant.isOpen('ending'), 'the session to end');
  });

  test('a replayable /verify with x-ng-checkpoint-close-follows keeps the session tracked and exported until its close', async () => {
    const probe = probeServer('exported', 'replay');
    const server = await startServer(probe);
    const cookie = await server.seed('r1');
    const headers = { 'x-ng-checkpoint-close-follows': '1' };
    expect((await server.post('/verify', {}, { cookie, key: 'r1', headers })).status).toBe(200);
    expect(server.participant.readiness().counts.sessions).toBe(1);
    await prepare(server, 'c1');
    expect((await commit(server, 'c1', ['r1'])).body.episode_ids).toEqual(['r1']);
    await resume(server, 'c1');
    await server.post('/close_session', {}, { cookie, key: 'r1' });
    expect(server.participant.readiness().counts.sessions).toBe(0);
  });

  test.each([
    ['replay', {}],
    ['wait', {}],
    ['wait', { 'x-ng-checkpoint-close-follows': '1' }],
  ] as const)('a %s /verify with headers %j ends the session at once', async (verify, headers) => {
    const server = await startServer(probeServer('exported', verify));
    const cookie = await server.seed('r1');
    await server.post('/verify', {}, { cookie, key: 'r1', headers });
    expect(server.participant.readiness().counts.sessions).toBe(0);
    await prepare(server, 'c1');
    expect((await commit(server, 'c1', ['r1'])).body.episode_ids).toEqual([]);
  });

  test('a server that ends sessions on its own route ends them through endSession', async () => {
    const server = await startServer(probeServer());
    const cookie = await server.seed('r1');
    await server.post('/finish', {}, { cookie, key: 'r1' });
    expect(server.participant.readiness().counts.sessions).toBe(0);
  });

  test('a commit does not export live sessions outside its scope', async () => {
    const probe = probeServer();
    const server = await startServer(probe);
    await server.seed('r1');
    await server.seed('r2');
    await prepare(server, 'c1');
    expect((await commit(server, 'c1', ['r2'])).body.episode_ids).toEqual(['r2']);
    expect(probe.calls.exported).toHaveLength(1);
    expect(probe.calls.exported[0]).toHaveLength(1);
  });

  test('a session the server no longer holds is left out of the export and no longer tracked', async () => {
    const probe = probeServer();
    probe.replaceIdWith = 'gone';
    const server = await startServer(probe);
    await server.seed('r1');
    probe.dropped.add('gone');
    await prepare(server, 'c1');
    const committed = await commit(server, 'c1', ['r1']);
    expect(committed.status).toBe(200);
    expect(committed.body.episode_ids).toEqual([]);
    expect(server.participant.isOpen('gone')).toBe(false);
  });
});
