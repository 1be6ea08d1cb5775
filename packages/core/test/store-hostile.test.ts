/**
 * A checkpoint directory is hostile input (issue 25): each test commits a real checkpoint, tampers
 * with its files on disk, expects the restore refused with 422 `invalid_checkpoint_state` naming
 * the file and the rule, then undoes the tampering and expects the same checkpoint to restore.
 */
import { execFileSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync } from 'node:fs';
import {
  cp,
  mkdtemp,
  readdir,
  readFile,
  rename,
  rm,
  stat,
  symlink,
  truncate,
  writeFile,
} from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { CheckpointStateError } from '../src/errors.js';
import { episodeId } from '../src/identity.js';
import type { JsonObject } from '../src/json.js';
import {
  MANIFEST_FILE,
  MAX_MANIFEST_BYTES,
  MAX_RECORD_LINE_BYTES,
  MAX_RECORDS_BYTES,
  participantDir,
  readParticipantState,
  writeParticipantState,
  type Manifest,
} from '../src/store.js';
import { harness, restoreRequest, useHarness, writeCheckpoint } from './control/harness.js';

const KIND = 'agent';
const INSTANCE = 'simple_agent';

let root: string;
beforeEach(async () => {
  root = await mkdtemp(join(tmpdir(), 'ckpt-gym-hostile-'));
});
afterEach(async () => {
  if (root) await rm(root, { recursive: true, force: true });
});

const dirOf = (checkpointDir: string) => participantDir(checkpointDir, KIND, INSTANCE);
const dir = () => dirOf(root);
const manifestPath = () => join(dir(), MANIFEST_FILE);
const sha256 = (bytes: Buffer | string) => createHash('sha256').update(bytes).digest('hex');

function commit(checkpointDir = root): Promise<Manifest> {
  return writeParticipantState({
    checkpointDir,
    kind: KIND,
    instance: INSTANCE,
    checkpointId: 'ckpt-1',
    records: [
      { episode_id: episodeId('r'), v: 1 },
      { episode_id: episodeId('s', 2), v: 2 },
    ],
  });
}

function restore(checkpointDir = root): Promise<{ manifest: Manifest; records: JsonObject[] }> {
  return readParticipantState<JsonObject>({
    checkpointDir,
    kind: KIND,
    instance: INSTANCE,
    select: () => true,
    validate: (r) => r,
  });
}

async function expectRefused(promise: Promise<unknown>, detail: RegExp | string): Promise<void> {
  const err = await promise.then(
    () => new Error('expected invalid_checkpoint_state, but the restore succeeded'),
    (e: unknown) => e,
  );
  expect(err).toBeInstanceOf(CheckpointStateError);
  expect((err as CheckpointStateError).code).toBe('invalid_checkpoint_state');
  expect((err as CheckpointStateError).status).toBe(422);
  expect((err as CheckpointStateError).message).toMatch(detail);
}

async function expectRestores(checkpointDir = root): Promise<void> {
  const { records } = await restore(checkpointDir);
  expect(records.map((r) => r.v)).toEqual([1, 2]);
}

/** Moves `path` aside, runs `tamper`, and returns a function putting the original back. */
async function replaced(
  path: string,
  tamper: () => Promise<unknown>,
): Promise<() => Promise<void>> {
  const aside = `${path}.aside`;
  await rename(path, aside);
  await tamper();
  return async () => {
    await rm(path, { recursive: true, force: true });
    await rename(aside, path);
  };
}

/** Rewrites the manifest as a participant would, keeping everything else. */
async function patchManifest(patch: (manifest: Record<string, unknown>) => string): Promise<void> {
  const manifest = JSON.parse(await readFile(manifestPath(), 'utf8')) as Record<string, unknown>;
  await writeFile(manifestPath(), patch(manifest));
}

/** Replaces the records with `lines` and makes the manifest agree (digest, count, size). */
async function forgeRecords(lines: string[]): Promise<void> {
  const bytes = Buffer.from(lines.map((line) => `${line}\n`).join(''));
  const digest = sha256(bytes);
  const name = `records-${digest}.jsonl`;
  await writeFile(join(dir(), name), bytes);
  await patchManifest((m) =>
    JSON.stringify({
      ...m,
      records_file: name,
      records_sha256: digest,
      record_count: lines.length,
      records_bytes: bytes.length,
    }),
  );
}

describe('the records file and the manifest must be regular files in the participant directory', () => {
  test('a records file that is a symlink to /dev/zero is refused at open, by the regular-file rule', async () => {
    const manifest = await commit();
    const path = join(dir(), manifest.records_file);
    const undo = await replaced(path, () => symlink('/dev/zero', path));
    await expectRefused(restore(), `${path} is a symlink: checkpoint files must be regular files`);
    await undo();
    await expectRestores();
  });

  // Only root may create a device node.
  (process.getuid?.() === 0 ? test : test.skip)(
    'a records file that is a device node (/dev/zero’s) is refused at open',
    async () => {
      const manifest = await commit();
      const path = join(dir(), manifest.records_file);
      const undo = await replaced(path, async () => execFileSync('mknod', [path, 'c', '1', '5']));
      await expectRefused(restore(), `${path} is not a regular file`);
      await undo();
      await expectRestores();
    },
  );

  test('a manifest that is a symlink to /dev/zero is refused', async () => {
    await commit();
    const undo = await replaced(manifestPath(), () => symlink('/dev/zero', manifestPath()));
    await expectRefused(restore(), `${manifestPath()} is a symlink`);
    await undo();
    await expectRestores();
  });

  test('a records file that is a symlink to an identical copy outside the directory is refused', async () => {
    const manifest = await commit();
    const path = join(dir(), manifest.records_file);
    const outside = join(root, 'copy.jsonl');
    await cp(path, outside);
    const undo = await replaced(path, () => symlink(outside, path));
    await expectRefused(restore(), `${path} is a symlink`);
    await undo();
    await expectRestores();
  });

  test('a FIFO records file is refused without blocking, and the process still restores after many', async () => {
    const manifest = await commit();
    const path = join(dir(), manifest.records_file);
    const undo = await replaced(path, async () => execFileSync('mkfifo', [path]));
    // More refusals than libuv has threads (4): a blocked open would take them all.
    for (let i = 0; i < 8; i++) {
      await expectRefused(restore(), `${path} is not a regular file`);
    }
    await undo();
    await expectRestores();
  });

  test('a manifest that is a FIFO is refused without blocking', async () => {
    await commit();
    const undo = await replaced(manifestPath(), async () =>
      execFileSync('mkfifo', [manifestPath()]),
    );
    for (let i = 0; i < 8; i++) {
      await expectRefused(restore(), `${manifestPath()} is not a regular file`);
    }
    await undo();
    await expectRestores();
  });

  test('a manifest larger than MAX_MANIFEST_BYTES is refused unread', async () => {
    await commit();
    const text = await readFile(manifestPath(), 'utf8');
    await truncate(manifestPath(), MAX_MANIFEST_BYTES + 1); // sparse: nothing to read but zeros
    await expectRefused(
      restore(),
      `${manifestPath()} is ${MAX_MANIFEST_BYTES + 1} bytes: a manifest may hold at most ${MAX_MANIFEST_BYTES}`,
    );
    await writeFile(manifestPath(), text);
    await expectRestores();
  });
});

describe('no symlink below the checkpoint directory', () => {
  test('gym/ a symlink to another checkpoint’s gym/ is refused', async () => {
    const other = join(root, 'other');
    const mine = join(root, 'mine');
    await commit(other);
    await commit(mine);
    const gym = join(mine, 'gym');
    const undo = await replaced(gym, () => symlink(join(other, 'gym'), gym));
    await expectRefused(
      restore(mine),
      `${dirOf(mine)} resolves to ${dirOf(other)}: a participant directory must not be reached through a symlink`,
    );
    await undo();
    await expectRestores(mine);
  });

  test('an instance directory that is a symlink is refused', async () => {
    const other = join(root, 'other');
    const mine = join(root, 'mine');
    await commit(other);
    await commit(mine);
    const undo = await replaced(dirOf(mine), () => symlink(dirOf(other), dirOf(mine)));
    await expectRefused(restore(mine), `${dirOf(mine)} resolves to ${dirOf(other)}`);
    await undo();
    await expectRestores(mine);
  });

  test('the checkpoint directory itself may be a symlink (a "latest" link)', async () => {
    const real = join(root, 'real');
    await commit(real);
    await symlink(real, join(root, 'latest'));
    await expectRestores(join(root, 'latest'));
  });
});

describe('never more bytes than the manifest declares', () => {
  test('a commit records the records file’s size as records_bytes', async () => {
    const manifest = await commit();
    const size = (await stat(join(dir(), manifest.records_file))).size;
    expect(manifest.records_bytes).toBe(size);
    expect(JSON.parse(await readFile(manifestPath(), 'utf8'))).toMatchObject({
      records_bytes: size,
    });
  });

  test('a records file of another size than records_bytes is refused', async () => {
    const manifest = await commit();
    const text = await readFile(manifestPath(), 'utf8');
    await patchManifest((m) =>
      JSON.stringify({ ...m, records_bytes: manifest.records_bytes! + 1 }),
    );
    await expectRefused(
      restore(),
      `${join(dir(), manifest.records_file)} is ${manifest.records_bytes} bytes, its manifest declares records_bytes ${manifest.records_bytes! + 1}`,
    );
    await writeFile(manifestPath(), text);
    await expectRestores();
  });

  test('a records_bytes that is not a count is refused', async () => {
    await commit();
    await patchManifest((m) => JSON.stringify({ ...m, records_bytes: -1 }));
    await expectRefused(restore(), `${manifestPath()} names an invalid records size`);
  });

  test('a manifest without records_bytes (as NeMo Gym writes) still restores', async () => {
    await commit();
    await patchManifest(({ records_bytes: _size, ...m }) => JSON.stringify(m));
    await expectRestores();
  });

  test('a records file beyond MAX_RECORDS_BYTES is refused unread', async () => {
    const manifest = await commit();
    const path = join(dir(), manifest.records_file);
    await patchManifest(({ records_bytes: _size, ...m }) => JSON.stringify(m));
    await truncate(path, MAX_RECORDS_BYTES + 1); // sparse
    await expectRefused(
      restore(),
      `${path} is ${MAX_RECORDS_BYTES + 1} bytes: a records file may hold at most ${MAX_RECORDS_BYTES}`,
    );
  });

  test('a line longer than MAX_RECORD_LINE_BYTES is refused once that much is buffered', async () => {
    const manifest = await commit();
    const path = join(dir(), manifest.records_file);
    const size = MAX_RECORD_LINE_BYTES + (8 << 20);
    // Past the two committed lines, sparse zeros: one endless line, as /dev/zero was.
    await truncate(path, size);
    await patchManifest((m) => JSON.stringify({ ...m, records_bytes: size }));
    await expectRefused(
      restore(),
      `${path} line 3 is longer than ${MAX_RECORD_LINE_BYTES} bytes, the most a record may hold`,
    );
  });
});

describe('per-participant checks', () => {
  test('a manifest giving checkpoint_id twice is refused', async () => {
    await commit();
    const text = await readFile(manifestPath(), 'utf8');
    await writeFile(manifestPath(), text.replace('{', '{\n "checkpoint_id": "forged",'));
    await expectRefused(
      restore(),
      `${manifestPath()} gives the key "checkpoint_id" twice: a manifest's keys must be unique`,
    );
    await writeFile(manifestPath(), text);
    await expectRestores();
  });

  test('a duplicate key is found however it is escaped, and only within one object', async () => {
    await commit();
    const text = await readFile(manifestPath(), 'utf8');
    // Keys equal to base keys, but in nested objects and strings: not duplicates.
    await writeFile(
      manifestPath(),
      text.replace('{', '{\n "x": [{"kind": 1}, {"kind": "\\"kind\\""}],'),
    );
    await expectRestores();
    await writeFile(manifestPath(), text.replace('{', '{\n "\\u006bind": "agent",'));
    await expectRefused(restore(), 'gives the key "kind" twice');
  });

  test('the same episode twice, digest consistent, is refused, in scope or not', async () => {
    await commit();
    const line = '{"episode_id":{"rollout_id":"r","attempt":0},"v":1}';
    await forgeRecords([line, '{"episode_id":{"rollout_id":"s","attempt":2},"v":2}', line]);
    const records = join(
      dir(),
      (JSON.parse(await readFile(manifestPath(), 'utf8')) as Manifest).records_file,
    );
    const detail = `${records} holds episode 'r' twice (lines 1 and 3): one record per episode`;
    await expectRefused(restore(), detail);
    await expectRefused(
      readParticipantState({
        checkpointDir: root,
        kind: KIND,
        instance: INSTANCE,
        select: () => false,
        validate: (r) => r,
      }),
      detail,
    );
  });

  test('an episode id of 5 MB, digest consistent, is refused by the capture-key length limit', async () => {
    await commit();
    const long = 'x'.repeat(5 << 20);
    await forgeRecords([`{"episode_id":{"rollout_id":"${long}","attempt":0},"v":1}`]);
    await expectRefused(
      restore(),
      /checkpoint record \(line 1 of .*records-[0-9a-f]{64}\.jsonl\) has no valid episode_id: episode_id: rollout_id of 5242880 characters is longer than 219$/,
    );
  });

  test('a manifest of another kind or instance is refused', async () => {
    await commit();
    await patchManifest((m) => JSON.stringify({ ...m, instance: 'other' }));
    await expectRefused(restore(), `${manifestPath()} belongs to "agent"/"other"`);
  });
});

describe('through the control plane, a refused restore leaves the participant idle', () => {
  useHarness();

  /** The participant directory's files, as a tampering sees them. */
  interface Files {
    readonly dir: string;
    readonly manifest: string;
    readonly records: string;
    readonly lines: string[];
  }

  /** Replaces the records with `lines`, with a manifest that agrees (digest, count, size). */
  async function forge(files: Files, lines: string[]): Promise<void> {
    const bytes = Buffer.from(lines.map((line) => `${line}\n`).join(''));
    const digest = sha256(bytes);
    const name = `records-${digest}.jsonl`;
    await writeFile(join(files.dir, name), bytes);
    const m = JSON.parse(await readFile(files.manifest, 'utf8')) as Record<string, unknown>;
    const patched = {
      ...m,
      records_file: name,
      records_sha256: digest,
      record_count: lines.length,
      records_bytes: bytes.length,
    };
    await writeFile(files.manifest, JSON.stringify(patched));
  }

  async function patch(files: Files, change: Record<string, unknown>): Promise<void> {
    const m = JSON.parse(await readFile(files.manifest, 'utf8')) as Record<string, unknown>;
    await writeFile(files.manifest, JSON.stringify({ ...m, ...change }));
  }

  const withRolloutId = (line: string, rolloutId: string) => {
    const record = JSON.parse(line) as { episode_id: Record<string, unknown> };
    return JSON.stringify({
      ...record,
      episode_id: { ...record.episode_id, rollout_id: rolloutId },
    });
  };

  test.each<[string, (files: Files) => Promise<unknown>, RegExp]>([
    [
      'records a symlink to /dev/zero',
      async (f) => rm(f.records).then(() => symlink('/dev/zero', f.records)),
      /is a symlink/,
    ],
    [
      'records a FIFO',
      async (f) => rm(f.records).then(() => execFileSync('mkfifo', [f.records])),
      /is not a regular file/,
    ],
    [
      'records a symlink to an identical copy outside the participant directory',
      async (f) => {
        const outside = `${f.dir}-outside.jsonl`;
        await cp(f.records, outside);
        await rm(f.records);
        await symlink(outside, f.records);
      },
      /is a symlink/,
    ],
    [
      'the manifest giving checkpoint_id twice',
      async (f) => {
        const text = await readFile(f.manifest, 'utf8');
        await writeFile(f.manifest, text.replace('{', '{\n "checkpoint_id": "forged",'));
      },
      /checkpoint_id.*twice|duplicate/i,
    ],
    [
      'the same episode twice, digest consistent',
      (f) => forge(f, [f.lines[0]!, f.lines[0]!]),
      /twice/,
    ],
    [
      'an episode id of 5 MB, digest consistent',
      (f) => forge(f, [withRolloutId(f.lines[0]!, 'x'.repeat(5_000_000))]),
      /characters|long/,
    ],
    [
      'records of another size than records_bytes',
      (f) => patch(f, { records_bytes: 1 }),
      /records_bytes/,
    ],
    ['a manifest of another instance', (f) => patch(f, { instance: 'another' }), /belongs to/],
  ])(
    '%s: 422, idle, nothing installed, then the untampered copy restores',
    async (_name, tamper, detail) => {
      const h = harness();
      await writeCheckpoint(h, 'src', [{ key: 'r', payload: { step: 3 } }]);
      const dir = participantDir(h.dir('src'), h.participant.kind, h.participant.instance);
      const undo = await replaced(dir, async () => {
        await cp(`${dir}.aside`, dir, { recursive: true });
        const manifest = join(dir, MANIFEST_FILE);
        const named = (JSON.parse(await readFile(manifest, 'utf8')) as Manifest).records_file;
        const records = join(dir, named);
        const lines = (await readFile(records, 'utf8')).split('\n').filter(Boolean);
        await tamper({ dir, manifest, records, lines });
      });
      await expect(h.plane.restore(restoreRequest(h, 'c9', 'src', ['r']))).rejects.toMatchObject({
        code: 'invalid_checkpoint_state',
        status: 422,
        message: expect.stringMatching(detail),
      });
      expect(h.plane.status()).toMatchObject({ phase: 'idle', checkpoint_id: null });
      expect(h.participant.restored.size).toBe(0);
      expect(h.participant.calls.install).toBe(0);
      await undo();
      const reply = await h.plane.restore(restoreRequest(h, 'c10', 'src', ['r']));
      expect(reply.restored).toEqual(['r-a1']);
    },
  );
});

describe('a commit whose last step fails removes what it published', () => {
  test('the directory fsync after the manifest link fails: no manifest, no records stay', async () => {
    let syncsOfDir = 0;
    const err = writeParticipantState({
      checkpointDir: root,
      kind: KIND,
      instance: INSTANCE,
      checkpointId: 'ckpt-1',
      records: [{ episode_id: episodeId('r'), v: 1 }],
      syncDirectory: async (path) => {
        // The participant directory is synced twice: before the link, and after it.
        if (path === dir() && ++syncsOfDir === 2) {
          throw Object.assign(new Error('EIO: i/o error, fsync'), {
            errno: -5,
            code: 'EIO',
            syscall: 'fsync',
          });
        }
      },
    });
    await expectRefused(err, `cannot write checkpoint state under ${dir()}: EIO`);
    expect(syncsOfDir).toBe(2);
    expect(await readdir(dir())).toEqual([]);
    expect(existsSync(manifestPath())).toBe(false);
    // The directory takes a fresh commit afterwards.
    await commit();
    await expectRestores();
  });
});

describe('files as private as the data', () => {
  const modeOf = async (path: string) => (await stat(path)).mode & 0o777;

  test('records and manifest are 0600 and created directories 0700, whatever the umask', async () => {
    const previous = process.umask(0); // a umask of 0 would leave open()'s 0666 as it is
    try {
      const checkpointDir = join(root, 'new');
      const manifest = await commit(checkpointDir);
      expect(await modeOf(join(dirOf(checkpointDir), manifest.records_file))).toBe(0o600);
      expect(await modeOf(join(dirOf(checkpointDir), MANIFEST_FILE))).toBe(0o600);
      for (const created of [
        checkpointDir,
        join(checkpointDir, 'gym'),
        join(checkpointDir, 'gym', KIND),
        dirOf(checkpointDir),
      ]) {
        expect([created, await modeOf(created)]).toEqual([created, 0o700]);
      }
    } finally {
      process.umask(previous);
    }
  });

  test('the caller’s modes are applied, and an existing parent keeps its own', async () => {
    const previous = process.umask(0o077); // would narrow 0640 to 0600
    try {
      const before = await modeOf(root);
      const manifest = await writeParticipantState({
        checkpointDir: root,
        kind: KIND,
        instance: INSTANCE,
        checkpointId: 'ckpt-1',
        records: [],
        fileMode: 0o640,
        dirMode: 0o750,
      });
      expect(await modeOf(join(dir(), manifest.records_file))).toBe(0o640);
      expect(await modeOf(manifestPath())).toBe(0o640);
      expect(await modeOf(dir())).toBe(0o750);
      expect(await modeOf(join(root, 'gym'))).toBe(0o750);
      expect(await modeOf(root)).toBe(before);
    } finally {
      process.umask(previous);
    }
  });
});
