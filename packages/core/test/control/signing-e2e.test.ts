/**
 * The stack file's checkpoint block end to end: gym apps built from a parsed stack file (so
 * `signing_key`, `file_mode` and `dir_mode` go settings → createGymApp → control plane → store), a
 * real commit over HTTP, a forgery on disk, and restores into fresh participants with and without
 * the key.
 */
import { createHash } from 'node:crypto';
import { mkdtemp, readFile, rm, stat, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { CHECKPOINT_ROUTE_PREFIX } from '../../src/coordination.js';
import { type GymApp, type ListeningServer, createGymApp, listen } from '../../src/server.js';
import { parseStackFile } from '../../src/settings.js';
import { MANIFEST_FILE, participantDir } from '../../src/store.js';
import { MemoryLogger, type TestRecord, TestParticipant } from '../support/test-participant.js';

const TOKEN = 'signing-token';
const SECRET = 'an-end-to-end-signing-secret-32-bytes-or-more';
const NAME = 'counter';
const KIND = 'resources';

interface Served {
  readonly participant: TestParticipant;
  readonly gym: GymApp<TestRecord>;
  readonly listening: ListeningServer;
}

let root = '';
const served: Served[] = [];

beforeEach(async () => {
  root = await mkdtemp(join(tmpdir(), 'ckpt-signing-e2e-'));
});

afterEach(async () => {
  for (const { gym, listening } of served.splice(0)) {
    gym.plane?.dispose();
    listening.server.closeAllConnections();
    await listening.close();
  }
  await rm(root, { recursive: true, force: true });
});

/** A fresh server process's participant, from a stack file with or without the signing key. */
async function serve(signed: boolean, checkpointLines: string[] = []): Promise<Served> {
  const text = [
    'checkpoint:',
    '  enabled: true',
    `  control_auth_token: ${TOKEN}`,
    ...(signed ? ['  signing_key: "${CKPT_GYM_SIGNING_KEY}"'] : []),
    ...checkpointLines,
    'servers:',
    `  ${NAME}: { kind: ${KIND}, app: counter, port: 0 }`,
    '',
  ].join('\n');
  const stack = parseStackFile(text, { env: { CKPT_GYM_SIGNING_KEY: SECRET } });
  const participant = new TestParticipant(NAME, KIND);
  const gym = createGymApp<TestRecord>({
    name: NAME,
    kind: KIND,
    checkpoint: stack.checkpoint,
    participant,
    logger: new MemoryLogger(),
  });
  const one = { participant, gym, listening: await listen(gym.finish(), 0) };
  served.push(one);
  return one;
}

async function control(
  server: Served,
  route: string,
  body: Record<string, unknown>,
): Promise<{ status: number; body: Record<string, unknown> }> {
  const reply = await fetch(`${server.listening.url}${CHECKPOINT_ROUTE_PREFIX}/${route}`, {
    method: 'POST',
    headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
    body: JSON.stringify({ deadline_ts: Date.now() / 1000 + 30, ...body }),
  });
  return { status: reply.status, body: (await reply.json()) as Record<string, unknown> };
}

const EPISODES = [
  { rollout_id: 'r1', attempt: 0 },
  { rollout_id: 'r2', attempt: 0 },
];
const checkpointDir = () => join(root, 'ckpt-1');
const manifestPath = () => join(participantDir(checkpointDir(), KIND, NAME), MANIFEST_FILE);

/** Two parked counter episodes committed over HTTP by a server with or without the key. */
async function commitCheckpoint(signed: boolean, checkpointLines: string[] = []): Promise<void> {
  const server = await serve(signed, checkpointLines);
  server.participant.start('r1', 'parked', { count: 1111 });
  server.participant.start('r2', 'parked', { count: 2222 });
  expect((await control(server, 'prepare', { checkpoint_id: 'ckpt-1' })).status).toBe(200);
  const committed = await control(server, 'commit', {
    checkpoint_id: 'ckpt-1',
    checkpoint_dir: checkpointDir(),
    episode_ids: EPISODES,
  });
  expect(committed.status).toBe(200);
}

/** The forger rewrites r1's count and makes the manifest's digest and file name consistent. */
async function forge(): Promise<void> {
  const manifest = JSON.parse(await readFile(manifestPath(), 'utf8')) as Record<string, unknown>;
  const recordsDir = participantDir(checkpointDir(), KIND, NAME);
  const oldPath = join(recordsDir, manifest.records_file as string);
  const forged = (await readFile(oldPath, 'utf8')).replace('"count":1111', '"count":9999');
  expect(forged).toContain('9999');
  const digest = createHash('sha256').update(forged).digest('hex');
  await writeFile(join(recordsDir, `records-${digest}.jsonl`), forged);
  await rm(oldPath);
  await rm(manifestPath());
  const patched = { ...manifest, records_file: `records-${digest}.jsonl`, records_sha256: digest };
  await writeFile(manifestPath(), JSON.stringify(patched, Object.keys(patched).sort(), 1));
}

function restore(server: Served) {
  return control(server, 'restore', {
    checkpoint_id: 'ckpt-9',
    checkpoint_dir: checkpointDir(),
    episode_ids: EPISODES,
  });
}

test('with the key, a signed checkpoint restores and a forged one is refused, leaving the participant idle', async () => {
  await commitCheckpoint(true);
  const manifest = JSON.parse(await readFile(manifestPath(), 'utf8')) as Record<string, unknown>;
  expect(manifest.mac).toMatch(/^hmac-sha256:[0-9a-f]{64}$/);

  const untampered = await serve(true);
  const restored = await restore(untampered);
  expect(restored).toMatchObject({ status: 200, body: { restored: ['r1-a1', 'r2-a1'] } });

  await forge();
  const fresh = await serve(true);
  const refused = await restore(fresh);
  expect(refused.status).toBe(422);
  expect(refused.body).toMatchObject({ error: { code: 'invalid_checkpoint_state' } });
  const detail = (refused.body.error as { detail: string }).detail;
  expect(detail).toContain(manifestPath());
  expect(detail).toContain('does not verify with checkpoint.signing_key');
  expect(fresh.participant.calls.install).toBe(0);
  expect(fresh.participant.restored.size).toBe(0);
  expect(fresh.gym.plane?.status()).toMatchObject({ phase: 'idle', checkpoint_id: null });
});

test('without the key, the same forgery restores (the digest alone proves nothing)', async () => {
  await commitCheckpoint(false);
  expect(await readFile(manifestPath(), 'utf8')).not.toContain('"mac"');
  await forge();
  const fresh = await serve(false);
  expect((await restore(fresh)).status).toBe(200);
  expect(fresh.participant.restored.get('r1-a1')?.payload).toEqual({ count: 9999 });
});

test('with the key, an unsigned checkpoint is refused', async () => {
  await commitCheckpoint(false);
  const fresh = await serve(true);
  const refused = await restore(fresh);
  expect(refused.status).toBe(422);
  expect((refused.body.error as { detail: string }).detail).toContain('carries no MAC');
  expect(fresh.participant.calls.install).toBe(0);
});

describe('file modes', () => {
  async function modes(): Promise<{ manifest: number; records: number; dir: number }> {
    const dir = participantDir(checkpointDir(), KIND, NAME);
    const manifest = JSON.parse(await readFile(manifestPath(), 'utf8')) as { records_file: string };
    const mode = async (path: string) => (await stat(path)).mode & 0o777;
    return {
      manifest: await mode(manifestPath()),
      records: await mode(join(dir, manifest.records_file)),
      dir: await mode(dir),
    };
  }

  test('a commit writes records and manifest 0600 in directories 0700 by default', async () => {
    await commitCheckpoint(false);
    expect(await modes()).toEqual({ manifest: 0o600, records: 0o600, dir: 0o700 });
  });

  test("the stack file's file_mode and dir_mode reach the files a commit writes", async () => {
    await commitCheckpoint(false, ['  file_mode: "0640"', '  dir_mode: "0750"']);
    expect(await modes()).toEqual({ manifest: 0o640, records: 0o640, dir: 0o750 });
  });
});
