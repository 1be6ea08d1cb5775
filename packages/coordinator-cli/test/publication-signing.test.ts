/**
 * `controller.json` under `checkpoint.signing_key`: published with a MAC, and a restore that takes
 * its scope from it refuses a forged or unsigned one. Without the key nothing changes.
 */
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { CheckpointStateError, episodeId } from '@ckpt-gym/core/protocol';

import {
  CONTROLLER_FILE,
  controllerRecord,
  publish,
  publishedScope,
  readControllerRecord,
} from '../src/publication.js';

const KEY = Buffer.from('a-controller-signing-key-of-32-bytes!');
const OTHER_KEY = Buffer.from('another-controller-signing-key-32b!!');

let dir = '';
beforeEach(async () => {
  dir = await mkdtemp(join(tmpdir(), 'ckpt-publication-'));
});
afterEach(async () => {
  await rm(dir, { recursive: true, force: true });
});

const record = () =>
  controllerRecord({
    checkpointId: 'c1',
    publishedAt: 1700000000,
    scope: [episodeId('r1', 0), episodeId('r2', 0)],
    restarts: [],
    recordCounts: { env: 2 },
    exportedByServer: {},
  });
const path = () => join(dir, CONTROLLER_FILE);

/** The scope a restore takes from the record, read (and with a key, verified) as restore reads it. */
async function scope(key?: Uint8Array) {
  return publishedScope(dir, await readControllerRecord(dir, key));
}

async function readJson(): Promise<Record<string, unknown>> {
  return JSON.parse(await readFile(path(), 'utf8')) as Record<string, unknown>;
}

async function expectRefused(promise: Promise<unknown>, detail: RegExp): Promise<void> {
  const err = await promise.then(
    () => new Error('the scope was accepted'),
    (e: unknown) => e,
  );
  expect(err).toBeInstanceOf(CheckpointStateError);
  expect((err as CheckpointStateError).code).toBe('invalid_checkpoint_state');
  expect((err as CheckpointStateError).message).toContain(path());
  expect((err as CheckpointStateError).message).toMatch(detail);
}

test('with the key the record carries a MAC and its scope reads back', async () => {
  await publish(dir, record(), KEY);
  expect((await readJson()).mac).toMatch(/^hmac-sha256:[0-9a-f]{64}$/);
  expect(await scope(KEY)).toEqual([episodeId('r1', 0), episodeId('r2', 0)]);
});

test('a scope forged to leave out an episode is refused with the key, and read without it', async () => {
  await publish(dir, record(), KEY);
  await writeFile(path(), JSON.stringify({ ...(await readJson()), episode_ids: ['r1'] }));
  await expectRefused(scope(KEY), /MAC that does not verify/);
  expect(await scope()).toEqual([episodeId('r1', 0)]);
});

test('a record signed with another key, or not signed, is refused with the key', async () => {
  await publish(dir, record(), OTHER_KEY);
  await expectRefused(scope(KEY), /MAC that does not verify/);
  await publish(dir, record());
  await expectRefused(scope(KEY), /carries no MAC/);
});

test('without the key no mac is written: the record is as before', async () => {
  await publish(dir, record());
  expect(await readFile(path(), 'utf8')).toBe(`${JSON.stringify(record(), null, 2)}\n`);
});
