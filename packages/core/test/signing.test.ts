/**
 * `checkpoint.signing_key`: manifests signed on commit and verified on restore, on real files. The
 * forger here does what anyone who can write the checkpoint directory can: rewrite the records
 * file, then make the manifest's digest and file name consistent with it.
 */
import { createHash, createHmac } from 'node:crypto';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { CheckpointStateError, ConfigError } from '../src/errors.js';
import { episodeId } from '../src/identity.js';
import { parseStackFile } from '../src/settings.js';
import { MAC_PREFIX, manifestMac, signed, verifyManifestMac } from '../src/signing.js';
import {
  MANIFEST_FILE,
  participantDir,
  readParticipantState,
  writeParticipantState,
  type CheckpointRecord,
} from '../src/store.js';

const KEY = Buffer.from('k'.repeat(32));
const OTHER_KEY = Buffer.from('o'.repeat(32));
const KIND = 'resources';
const INSTANCE = 'counter';

let root: string;
beforeEach(async () => {
  root = await mkdtemp(join(tmpdir(), 'ckpt-gym-signing-'));
});
afterEach(async () => {
  if (root) await rm(root, { recursive: true, force: true });
});

const dir = () => participantDir(root, KIND, INSTANCE);
const manifestPath = () => join(dir(), MANIFEST_FILE);
const sha256 = (bytes: Buffer | string) => createHash('sha256').update(bytes).digest('hex');

function counterRecords(): CheckpointRecord[] {
  return [
    { episode_id: episodeId('r1', 0), count: 1111 },
    { episode_id: episodeId('r2', 0), count: 2222 },
  ];
}

function commit(signingKey?: Buffer) {
  return writeParticipantState({
    checkpointDir: root,
    kind: KIND,
    instance: INSTANCE,
    checkpointId: 'ckpt-1',
    records: counterRecords(),
    ...(signingKey ? { signingKey } : {}),
  });
}

function restore(signingKey?: Buffer) {
  return readParticipantState({
    checkpointDir: root,
    kind: KIND,
    instance: INSTANCE,
    select: () => true,
    validate: (record) => record,
    ...(signingKey ? { signingKey } : {}),
  });
}

async function readManifestJson(): Promise<Record<string, unknown>> {
  return JSON.parse(await readFile(manifestPath(), 'utf8')) as Record<string, unknown>;
}

/** Writes the manifest back as the store writes it (sorted keys, one-space indent). */
async function writeManifestJson(manifest: Record<string, unknown>): Promise<void> {
  const sorted = Object.fromEntries(Object.entries(manifest).sort(([a], [b]) => (a < b ? -1 : 1)));
  await rm(manifestPath());
  await writeFile(manifestPath(), JSON.stringify(sorted, null, 1));
}

/**
 * The forgery: r1's count becomes 9999 (same length, so the file's size and line count stay), the
 * records file is renamed to its new digest, and the manifest names that digest and file.
 */
async function forgeCounter(): Promise<void> {
  const manifest = await readManifestJson();
  const oldPath = join(dir(), manifest.records_file as string);
  const forged = (await readFile(oldPath, 'utf8')).replace('"count":1111', '"count":9999');
  expect(forged).toContain('9999');
  const digest = sha256(forged);
  const newFile = `records-${digest}.jsonl`;
  await writeFile(join(dir(), newFile), forged);
  await rm(oldPath);
  await writeManifestJson({ ...manifest, records_file: newFile, records_sha256: digest });
}

async function expectRefused(promise: Promise<unknown>, detail: RegExp): Promise<void> {
  const err = await promise.then(
    () => new Error('the restore was accepted'),
    (e: unknown) => e,
  );
  expect(err).toBeInstanceOf(CheckpointStateError);
  expect((err as CheckpointStateError).code).toBe('invalid_checkpoint_state');
  expect((err as CheckpointStateError).status).toBe(422);
  expect((err as CheckpointStateError).message).toContain(manifestPath());
  expect((err as CheckpointStateError).message).toMatch(detail);
}

describe('signed manifests on disk', () => {
  test('a forged record with a consistent digest restores without the key', async () => {
    await commit();
    await forgeCounter();
    const { records } = await restore();
    expect(records).toContainEqual({ episode_id: { rollout_id: 'r1', attempt: 0 }, count: 9999 });
  });

  test('the same forgery is refused when the checkpoint was signed and the key is set', async () => {
    await commit(KEY);
    await forgeCounter();
    await expectRefused(restore(KEY), /MAC that does not verify with checkpoint\.signing_key/);
  });

  test('an untampered signed checkpoint restores, and its manifest carries the MAC', async () => {
    const manifest = await commit(KEY);
    expect(manifest.mac).toMatch(/^hmac-sha256:[0-9a-f]{64}$/);
    expect(await readManifestJson()).toEqual(manifest);
    const { records, manifest: back } = await restore(KEY);
    expect(records.map((r) => r.count)).toEqual([1111, 2222]);
    expect(back.mac).toBe(manifest.mac);
  });

  test('a manifest signed with another key is refused', async () => {
    await commit(OTHER_KEY);
    await expectRefused(restore(KEY), /MAC that does not verify/);
  });

  test('a manifest without a MAC is refused when the key is set', async () => {
    await commit();
    await expectRefused(restore(KEY), /carries no MAC, and checkpoint\.signing_key requires/);
  });

  test('a malformed MAC is refused by its form', async () => {
    await commit(KEY);
    const manifest = await readManifestJson();
    await writeManifestJson({ ...manifest, mac: (manifest.mac as string).toUpperCase() });
    await expectRefused(restore(KEY), /malformed MAC/);
  });

  test('a manifest whose checkpoint_id was changed under its MAC does not verify', async () => {
    await commit(KEY);
    const manifest = await readManifestJson();
    await writeManifestJson({ ...manifest, checkpoint_id: 'ckpt-2' });
    await expectRefused(restore(KEY), /does not verify/);
  });

  test('without the key no mac field is written: the manifest is the signed one minus its mac line', async () => {
    const signedDir = join(root, 'signed');
    const signedManifest = await writeParticipantState({
      checkpointDir: signedDir,
      kind: KIND,
      instance: INSTANCE,
      checkpointId: 'ckpt-1',
      records: counterRecords(),
      signingKey: KEY,
    });
    const signedText = await readFile(
      join(participantDir(signedDir, KIND, INSTANCE), MANIFEST_FILE),
      'utf8',
    );
    const manifest = await commit();
    const text = await readFile(manifestPath(), 'utf8');
    expect(manifest).not.toHaveProperty('mac');
    expect(text).not.toContain('"mac"');
    expect(text).toBe(JSON.stringify(manifest, Object.keys(manifest).sort(), 1));
    // The mac key sorts between instance and record_count, with a comma of its own.
    expect(signedText.replace(` "mac": "${signedManifest.mac as string}",\n`, '')).toBe(text);
  });

  test('a signed manifest is still read without the key (a MAC is an extra key to a reader)', async () => {
    await commit(KEY);
    const { records } = await restore();
    expect(records).toHaveLength(2);
  });

  test('a signed re-commit of the same records is idempotent', async () => {
    const first = await commit(KEY);
    await expect(commit(KEY)).resolves.toEqual(first);
  });
});

describe('the MAC functions', () => {
  const manifest = { b: 1, a: 'x', nested: { z: [1, 2], y: 'é' } };

  test('the MAC is HMAC-SHA256 over sorted compact JSON without the mac field', () => {
    const canonical = '{"a":"x","b":1,"nested":{"y":"é","z":[1,2]}}';
    const expected = createHmac('sha256', KEY).update(canonical, 'utf8').digest('hex');
    expect(manifestMac(KEY, manifest)).toBe(`${MAC_PREFIX}${expected}`);
    expect(manifestMac(KEY, { ...manifest, mac: 'anything' })).toBe(`${MAC_PREFIX}${expected}`);
  });

  test('verify accepts what signed made, and refuses another key or a changed value', () => {
    const value = signed(KEY, manifest);
    expect(() => verifyManifestMac(KEY, value, 'm.json')).not.toThrow();
    expect(() => verifyManifestMac(OTHER_KEY, value, 'm.json')).toThrow(/m\.json has a MAC/);
    expect(() => verifyManifestMac(KEY, { ...value, b: 2 }, 'm.json')).toThrow(/does not verify/);
    expect(() => verifyManifestMac(KEY, { ...value, mac: 7 }, 'm.json')).toThrow(/malformed/);
  });
});

describe('checkpoint.signing_key in the stack file', () => {
  const SOURCE = '/stacks/ckpt-gym.yaml';
  const stack = (key: string) =>
    [
      'checkpoint:',
      '  enabled: true',
      '  control_auth_token: tok',
      `  signing_key: ${key}`,
      'servers:',
      '  counter: { kind: resources, app: counter, port: 0 }',
      '',
    ].join('\n');
  const parse = (text: string, env: Record<string, string> = {}) =>
    parseStackFile(text, { env, source: SOURCE });

  test('the key is read from the environment variable the file names, as UTF-8 bytes', () => {
    const secret = 'a-signing-secret-of-at-least-32-bytes';
    const settings = parse(stack('${CKPT_GYM_SIGNING_KEY}'), { CKPT_GYM_SIGNING_KEY: secret });
    expect(settings.checkpoint?.signingKey).toEqual(Buffer.from(secret, 'utf8'));
  });

  test('without the key the settings carry none', () => {
    const text = stack('x').replace(/ {2}signing_key: x\n/, '');
    expect(parse(text).checkpoint).toEqual({
      enabled: true,
      controlAuthToken: 'tok',
      leaseGraceSeconds: 600,
    });
  });

  test.each([
    ['too short', 'short-secret', 12],
    ['empty', '', 0],
    ['31 bytes', 'x'.repeat(31), 31],
  ])('a key that is %s is invalid_config, naming the key, never its value', (_case, secret, n) => {
    const err = (() => {
      try {
        parse(stack('"${KEY}"'), { KEY: secret });
      } catch (e) {
        return e;
      }
      throw new Error('the stack file was accepted');
    })();
    expect(err).toBeInstanceOf(ConfigError);
    expect((err as ConfigError).code).toBe('invalid_config');
    expect((err as ConfigError).message).toBe(
      `${SOURCE}: checkpoint.signing_key: must be at least 32 bytes of UTF-8, got ${n}`,
    );
  });

  test('an unset variable is refused as every reference is', () => {
    expect(() => parse(stack('${CKPT_GYM_SIGNING_KEY}'))).toThrow(
      `${SOURCE}: checkpoint.signing_key: environment variable CKPT_GYM_SIGNING_KEY is not set`,
    );
  });

  test('a key that reads as a number must be quoted, as documented', () => {
    const digits = '1'.repeat(40);
    expect(parse(stack('"${KEY}"'), { KEY: digits }).checkpoint?.signingKey).toEqual(
      Buffer.from(digits),
    );
    expect(() => parse(stack('${KEY}'), { KEY: digits })).toThrow(
      `${SOURCE}: checkpoint.signing_key: must be string`,
    );
  });

  test('multi-byte characters count as their UTF-8 bytes', () => {
    const secret = 'é'.repeat(16); // 16 characters, 32 bytes
    expect(parse(stack('"${KEY}"'), { KEY: secret }).checkpoint?.signingKey).toHaveLength(32);
  });
});
