import { participantDir } from '@ckpt-gym/core/server';
import { until, writeCorruptedCopy } from '@ckpt-gym/testing';
import { jest } from '@jest/globals';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';

import { counterServer, SessionTable, weatherServer } from '../src/index.js';
import { type Probe, probeServer } from './probe.js';
import {
  checkpoint,
  cleanUp,
  episodeJson,
  restore,
  startServer,
  tempDir,
  track,
} from './support.js';

afterEach(async () => {
  jest.restoreAllMocks();
  await cleanUp();
});

const soon = (): number => Date.now() / 1000 + 30;

function nativeSeed(id: string, key: string, taskData: object) {
  return {
    resources_session_id: id,
    episode_id: episodeJson(key),
    task_id: { taskset: 'ts', task_id: id },
    task_data: taskData,
  };
}

describe('the counter across a crash', () => {
  test('restored counter state gives the reward, and a fresh process without the restore does not', async () => {
    const first = await startServer(counterServer());
    const seed = await first.post('/seed_session', nativeSeed('s1', 'r1', { expected_count: 3 }), {
      key: 'r1',
    });
    const cookie = seed.setCookie as string;
    await first.post('/increment_counter', { count: 3 }, { cookie, key: 'r1' });
    const dir = await checkpoint(first, 'c1', ['r1']);
    await first.close();

    const second = await startServer(counterServer());
    expect((await restore(second, 'c2', dir, ['r1'])).restored).toEqual(['r1-a1']);
    const verified = await second.post('/verify', { expected_count: 3 }, { cookie, key: 'r1-a1' });
    expect(verified.body.reward).toBe(1);

    const unrestored = await startServer(counterServer());
    const control = await unrestored.post(
      '/verify',
      { expected_count: 3 },
      { cookie, key: 'r1-a1' },
    );
    expect(control.body.reward).toBe(0);
  });
});

describe('a replayable verify whose close follows', () => {
  test('the session is exported after the verification, and a restore verifies again and closes it', async () => {
    const first = probeServer('exported', 'replay');
    const server = await startServer(first);
    const cookie = await server.seed('r1');
    await server.post('/bump', {}, { cookie, key: 'r1' });
    const headers = { 'x-ng-checkpoint-close-follows': '1' };
    expect((await server.post('/verify', {}, { cookie, key: 'r1', headers })).body.reward).toBe(1);
    const dir = await checkpoint(server, 'c1', ['r1']);
    await server.close();

    const again = probeServer('exported', 'replay');
    const restored = await startServer(again);
    await restore(restored, 'c2', dir, ['r1']);
    const verified = await restored.post('/verify', {}, { cookie, key: 'r1-a1', headers });
    expect(verified.body.reward).toBe(1);
    expect((await restored.post('/close_session', {}, { cookie, key: 'r1-a1' })).status).toBe(200);
    expect(restored.participant.readiness().counts.sessions).toBe(0);
    expect(again.values.size).toBe(0);
  });
});

describe('restored sessions', () => {
  let probe: Probe;
  let cookies: Record<string, string>;
  let dir: string;

  /** A checkpoint of sessions under r1 and r2 (values 1 and 2), taken by a server that is then closed. */
  beforeEach(async () => {
    const source = probeServer();
    const server = await startServer(source);
    cookies = { r1: await server.seed('r1'), r2: await server.seed('r2') };
    await server.post('/bump', {}, { cookie: cookies.r1, key: 'r1' });
    await server.post('/bump', {}, { cookie: cookies.r2, key: 'r2' });
    await server.post('/bump', {}, { cookie: cookies.r2, key: 'r2' });
    dir = await checkpoint(server, 'c0', ['r1', 'r2']);
    await server.close();
    probe = probeServer();
  });

  test('after a restore, a call under the replaced attempt is refused with stale_attempt and a cookie-only call with rollout_id_required, and neither claims the session', async () => {
    const server = await startServer(probe);
    await restore(server, 'c1', dir, ['r1', 'r2']);
    const stale = await server.post('/bump', {}, { cookie: cookies.r1, key: 'r1' });
    const cookieOnly = await server.post('/bump', {}, { cookie: cookies.r1 });
    expect(stale.body.error).toMatchObject({ code: 'stale_attempt' });
    expect(cookieOnly.status).toBe(400);
    expect(cookieOnly.body.error).toMatchObject({ code: 'rollout_id_required' });
    expect(probe.calls.tool).toBe(0);
    expect(
      server.participant
        .restoredPending()
        .map((e) => e.rollout_id)
        .sort(),
    ).toEqual(['r1', 'r2']);
    expect((await server.post('/bump', {}, { cookie: cookies.r1, key: 'r1-a1' })).body).toEqual({
      value: 2,
    });
    expect(server.participant.restoredPending().map((e) => e.rollout_id)).toEqual(['r2']);
    // Still refused once claimed: the cookie cannot tell the replacement from the replaced attempt.
    expect((await server.post('/bump', {}, { cookie: cookies.r1 })).status).toBe(400);
  });

  test('after a restore, a close from the replaced attempt is refused and keeps the session', async () => {
    const server = await startServer(probe);
    await restore(server, 'c1', dir, ['r1']);
    const close = await server.post('/close_session', {}, { cookie: cookies.r1, key: 'r1' });
    expect(close.body.error).toMatchObject({ code: 'stale_attempt' });
    expect(probe.calls.close).toBe(0);
    expect([...probe.values.values()]).toEqual([1]);
  });

  test('across two restores the first replacement is refused too', async () => {
    const middle = await startServer(probe);
    await restore(middle, 'c1', dir, ['r1']);
    const again = await checkpoint(middle, 'c2', ['r1-a1']);
    await middle.close();
    const last = await startServer(probeServer());
    expect((await restore(last, 'c3', again, ['r1-a1'])).restored).toEqual(['r1-a2']);
    expect(
      (await last.post('/bump', {}, { cookie: cookies.r1, key: 'r1-a1' })).body.error,
    ).toMatchObject({
      code: 'stale_attempt',
    });
    expect((await last.post('/bump', {}, { cookie: cookies.r1 })).status).toBe(400);
    expect((await last.post('/bump', {}, { cookie: cookies.r1, key: 'r1-a2' })).body).toEqual({
      value: 2,
    });
  });

  test("a commit whose scope leaves out a restored session deletes it through the server's hook, refusing nothing later", async () => {
    const server = await startServer(probe);
    await restore(server, 'c1', dir, ['r1', 'r2']);
    await checkpoint(server, 'c2', ['r2-a1']);
    expect(probe.calls.exported).toEqual([[expect.any(String)]]);
    expect(probe.calls.retired).toHaveLength(1);
    expect(server.participant.restoredPending().map((e) => e.rollout_id)).toEqual(['r2']);
    expect((await server.post('/seed_session', {}, { key: 'r1-a1' })).status).toBe(200);
  });

  test('a restored session the server drops before any request uses it does not break the commit', async () => {
    const server = await startServer(probe);
    await restore(server, 'c1', dir, ['r1', 'r2']);
    for (const id of probe.values.keys()) probe.dropped.add(id);
    const again = await tempDir();
    await server.ok('prepare', { checkpoint_id: 'c2' });
    const committed = await server.ok('commit', {
      checkpoint_id: 'c2',
      checkpoint_dir: again,
      episode_ids: [episodeJson('r1-a1')],
    });
    expect(committed.episode_ids).toEqual([]);
  });

  test("deleting one rollout's restored sessions does not scan every restored session", async () => {
    const server = await startServer(probe);
    await restore(server, 'c1', dir, ['r1', 'r2']);
    const scan = jest.spyOn(SessionTable.prototype, 'all').mockImplementation(() => {
      throw new Error('scanned every session');
    });
    await server.participant.deleteRestored(episodeJson('r1-a1') as never);
    expect(scan).not.toHaveBeenCalled();
    expect(probe.calls.retired).toHaveLength(1);
  });

  test('a restore into a process that has served sessions is refused', async () => {
    const server = await startServer(probe);
    await server.seed('r9');
    const refused = await server.control('restore', {
      checkpoint_id: 'c1',
      deadline_ts: soon(),
      checkpoint_dir: dir,
      episode_ids: [episodeJson('r1')],
    });
    expect(refused.body.error).toMatchObject({ code: 'checkpoint_error' });
    expect(String((refused.body.error as { detail: string }).detail)).toMatch(
      /has not served sessions/,
    );
  });

  test('a stateless server cannot restore session records', async () => {
    const server = await startServer(weatherServer());
    const refused = await server.control('restore', {
      checkpoint_id: 'c1',
      deadline_ts: soon(),
      checkpoint_dir: dir,
      episode_ids: [episodeJson('r1')],
    });
    expect(refused.body.error).toMatchObject({ code: 'checkpoint_error' });
    expect(String((refused.body.error as { detail: string }).detail)).toMatch(
      /stateless resources server cannot restore/,
    );
  });

  test('a seed still waiting out a restore does not hold up a retire, and its mark refuses it once admitted', async () => {
    const server = await startServer(probe);
    await server.ok('restore', {
      checkpoint_id: 'c1',
      checkpoint_dir: dir,
      episode_ids: [episodeJson('r1')],
    });
    const seed = track(server.post('/seed_session', {}, { key: 'r5' }));
    await until(() => server.participant.readiness().counts.waiting === 1, 'the seed to wait');
    expect(
      (
        await server.control('retire', {
          checkpoint_id: 'c1',
          deadline_ts: soon(),
          episode_ids: [episodeJson('r5')],
        })
      ).status,
    ).toBe(200);
    await server.ok('resume', { checkpoint_id: 'c1' });
    expect((await seed.promise).body.error).toMatchObject({ code: 'stale_attempt' });
    expect(probe.calls.seed).toBe(0);
  });
});

describe('restored states decoded when first used', () => {
  /** A copy of checkpoint `from` whose `rollout` record holds `text` as its state. */
  async function withState(from: string, rollout: string, text: string): Promise<string> {
    const to = await tempDir();
    await writeCorruptedCopy({
      ...{ from, to, kind: 'resources', instance: 'res', checkpointId: 'c1' },
      ...{ rollout, field: 'state', text },
    });
    return to;
  }

  async function recordsText(dir: string): Promise<string> {
    const at = participantDir(dir, 'resources', 'res');
    const manifest = JSON.parse(await readFile(join(at, 'manifest.json'), 'utf8')) as {
      records_file: string;
    };
    return readFile(join(at, manifest.records_file), 'utf8');
  }

  test('a restored session whose state is not JSON restores; its first use is a typed error naming it, the others work', async () => {
    const first = await startServer(counterServer());
    const one = await first.seed('r1', { initial_count: 1 });
    const two = await first.seed('r2', { initial_count: 2 });
    const dir = await checkpoint(first, 'c0', ['r1', 'r2']);
    await first.close();
    // Past DEFER_DECODE_MIN_BYTES (a smaller record is decoded, and refused, at restore).
    const pad = 'x'.repeat(20_000);
    const padded = await withState(dir, 'r2', `{"count":2,"pad":"${pad}"}`);
    const broken = await withState(padded, 'r1', `{"count":tru,"pad":"${pad}"}`);

    const server = await startServer(counterServer());
    expect((await restore(server, 'c1', broken, ['r1', 'r2'])).restored).toEqual([
      'r1-a1',
      'r2-a1',
    ]);
    for (let i = 0; i < 2; i++) {
      const used = await server.post('/get_counter_value', {}, { cookie: one, key: 'r1-a1' });
      expect(used.status).toBe(422);
      expect(used.body.error).toMatchObject({ code: 'invalid_checkpoint_state' });
      expect(JSON.stringify(used.body)).toContain("'r1'");
    }
    const counted = await server.post('/get_counter_value', {}, { cookie: two, key: 'r2-a1' });
    expect(counted.body).toEqual({ count: 2 });
    // The broken state is exported as it was read: it stays what it was, never a new counter.
    const next = await checkpoint(server, 'c2', ['r1-a1', 'r2-a1']);
    const text = await recordsText(next);
    expect(text).toContain('"state":{"count":tru,"pad":');
    expect(text).toContain('"state":{"count":2}');
  });

  test('a large restored state the server refuses is invalid_checkpoint_state naming the episode at its first use, never a 500', async () => {
    const first = await startServer(counterServer());
    const one = await first.seed('r1', { initial_count: 1 });
    const dir = await checkpoint(first, 'c0', ['r1']);
    await first.close();
    const refused = await withState(dir, 'r1', `{"count":"x","pad":"${'x'.repeat(20_000)}"}`);
    const server = await startServer(counterServer());
    await restore(server, 'c1', refused, ['r1']);
    const used = await server.post('/get_counter_value', {}, { cookie: one, key: 'r1-a1' });
    expect(used.status).toBe(422);
    expect(used.body.error).toMatchObject({ code: 'invalid_checkpoint_state' });
    expect(JSON.stringify(used.body)).toContain("'r1'");
    expect(JSON.stringify(used.body)).toContain('invalid counter state');
  });
});
