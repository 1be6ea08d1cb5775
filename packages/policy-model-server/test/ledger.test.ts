import { execFile, execFileSync } from 'node:child_process';
import { closeSync, constants, openSync, utimesSync } from 'node:fs';
import { mkdir, open, readdir, readFile, rm, stat, writeFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { join } from 'node:path';

import { afterEach, describe, expect, it } from '@jest/globals';

import {
  captureKey,
  encodeJson,
  episodeId,
  MAX_ATTEMPT,
  MAX_CAPTURE_KEY_LENGTH,
  MAX_ROLLOUT_ID_LENGTH,
} from '@ckpt-gym/core/protocol';
import { deadline, until } from '@ckpt-gym/testing';
import lockfile from 'proper-lockfile';

import { CaptureLedger, lockStripe, TOKEN_SUFFIXES } from '../src/index.js';
import {
  chat,
  cleanup,
  control,
  fakeCalls,
  fakeCtl,
  post,
  rawCall,
  startFake,
  startHarness,
  tempDir,
  TOKEN,
} from './support.js';

afterEach(cleanup);

const require = createRequire(import.meta.url);

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
const row = (id: string, extra: object = {}) => ({ model_call_id: id, ...extra });
const rowsOf = async (ledger: CaptureLedger, keys: string[]) =>
  (await ledger.exportMany(keys)).map((l) => l.rows);

async function ledgerAt(): Promise<CaptureLedger> {
  return new CaptureLedger(await tempDir()).init();
}

async function files(ledger: CaptureLedger): Promise<string[]> {
  return (await readdir(ledger.dir)).filter((f) => f !== '.locks').sort();
}

/** A ledger that records the directory's files at each of its directory syncs. */
class Watched extends CaptureLedger {
  synced: string[][] = [];
  override async syncDirectory(): Promise<void> {
    await super.syncDirectory();
    this.synced.push(await files(this));
  }
}

describe('CaptureLedger files', () => {
  it('appends rows to <key>.lineage.jsonl and reads them back faithfully', async () => {
    const ledger = await ledgerAt();
    await ledger.append('r-a1', row('c1', { logprob: -Infinity }));
    await ledger.append('r-a1', row('c2'));
    expect(await ledger.exportRows('r-a1')).toEqual([row('c1', { logprob: -Infinity }), row('c2')]);
    expect(await files(ledger)).toEqual(['r-a1.lineage.jsonl']);
  });

  it('retire fences, then deletes the ledger and started marker; a late row is discarded', async () => {
    const ledger = await ledgerAt();
    await ledger.append('r', row('c1'));
    await ledger.markStarted('r');
    expect(await ledger.retire(['r', 'r', 's'])).toEqual({ removed: ['r'], absent: ['s'] });
    expect(await files(ledger)).toEqual(['r.lineage.retired', 's.lineage.retired']);
    expect(await ledger.append('r', row('late'))).toBe('discarded');
    expect(await ledger.exportRows('r')).toEqual([]);
    await expect(ledger.manifest('r')).rejects.toMatchObject({ name: 'LedgerRetiredError' });
    expect(await ledger.markStarted('s')).toBe(false);
  });

  it('delete removes ledger, fence and started marker, so the key can be used again', async () => {
    const ledger = await ledgerAt();
    await ledger.append('r', row('c1'));
    await ledger.markStarted('r');
    await ledger.retire(['s']);
    expect(await ledger.delete(['r', 's'])).toEqual({ removed: ['r'], absent: ['s'] });
    expect(await files(ledger)).toEqual([]);
    expect(await ledger.append('s', row('c2'))).toBe('written');
  });

  it('refuses a batch with an invalid id as a whole', async () => {
    const ledger = await ledgerAt();
    await ledger.append('r', row('c1'));
    await expect(ledger.retire(['r', 'bad!id'])).rejects.toMatchObject({
      code: 'invalid_rollout_id',
    });
    expect(await ledger.exportRows('r')).toHaveLength(1);
  });

  it("holds core's longest capture key: every file named after it fits a file name", async () => {
    // Core derives MAX_ROLLOUT_ID_LENGTH from this ledger's longest suffix; a longer one fails here.
    const key = captureKey(episodeId('r'.repeat(MAX_ROLLOUT_ID_LENGTH), MAX_ATTEMPT));
    expect(key.length).toBeLessThanOrEqual(MAX_CAPTURE_KEY_LENGTH);
    const ledger = await ledgerAt();
    // Token-store files a dead execution may leave; the import deletes them.
    for (const suffix of TOKEN_SUFFIXES)
      await writeFile(join(ledger.dir, `${key}${suffix}`), 'x\n');
    await ledger.importMany(new Map([[key, [row('c1')]]]));
    expect(await ledger.markStarted(key)).toBe(true);
    expect(await files(ledger)).toEqual([`${key}.lineage.jsonl`, `${key}.lineage.started`]);
    expect(await ledger.retire([key])).toEqual({ removed: [key], absent: [] });
    expect(await files(ledger)).toEqual([`${key}.lineage.retired`]);
  });

  it('import replaces the target ledger and deletes what dead executions left for it and later attempts, look-alikes untouched', async () => {
    const ledger = await ledgerAt();
    const touch = (name: string) => writeFile(join(ledger.dir, name), 'x\n');
    await ledger.append('r-a1', row('dead-1'));
    await touch('r-a1.tokens.jsonl');
    await touch('r-a2.lineage.retired');
    await touch('r-a2.tokens.incomplete');
    await touch('r-a3.lineage.started');
    await ledger.append('r', row('kept-a0'));
    for (const name of ['r1-a2.lineage.jsonl', 'r-a1x-a3.lineage.jsonl', 'rr-a1.lineage.retired'])
      await touch(name);
    await ledger.importMany(new Map([['r-a1', [row('c1', { capture_key: 'r' })]]]));
    expect(await files(ledger)).toEqual([
      'r-a1.lineage.jsonl',
      'r-a1x-a3.lineage.jsonl',
      'r.lineage.jsonl',
      'r1-a2.lineage.jsonl',
      'rr-a1.lineage.retired',
    ]);
    expect(await ledger.exportRows('r-a1')).toEqual([row('c1', { capture_key: 'r' })]);
    // Restoring the same checkpoint again after the replacement appended rows yields only the checkpointed rows.
    await ledger.append('r-a1', row('replacement'));
    await ledger.importMany(new Map([['r-a1', [row('c1', { capture_key: 'r' })]]]));
    expect(await ledger.exportRows('r-a1')).toEqual([row('c1', { capture_key: 'r' })]);
  });

  it('marks a restored attempt started exclusively, and deleteUnstarted keeps a started ledger', async () => {
    const ledger = await ledgerAt();
    await ledger.importMany(
      new Map([
        ['r-a1', [row('c1')]],
        ['s-a1', [row('c2')]],
      ]),
    );
    expect(await ledger.markStarted('r-a1')).toBe(true);
    expect(await ledger.markStarted('r-a1')).toBe(true);
    expect(await ledger.deleteUnstarted('r-a1')).toBe(false);
    expect(await ledger.deleteUnstarted('s-a1')).toBe(true);
    expect(await files(ledger)).toEqual(['r-a1.lineage.jsonl', 'r-a1.lineage.started']);
  });

  it('the started marker is removed by a ledger retire, a ledger delete and a restore that clears the attempt', async () => {
    const ledger = await ledgerAt();
    for (const key of ['a-a1', 'b-a1', 'c-a1']) {
      await ledger.append(key, row(key));
      await ledger.markStarted(key);
    }
    await ledger.retire(['a-a1']);
    await ledger.delete(['b-a1']);
    await ledger.importMany(new Map([['c-a1', []]]));
    expect((await files(ledger)).filter((f) => f.endsWith('.started'))).toEqual([]);
  });

  it('exportMany reads each key’s rows in order, none for a key without a ledger, and stops when aborted', async () => {
    const ledger = await ledgerAt();
    const keys = Array.from({ length: 150 }, (_, i) => `r${i}-a1`);
    for (const [i, key] of keys.entries()) if (i % 3 !== 0) await ledger.append(key, row(`c${i}`));
    const rows = await rowsOf(ledger, keys);
    expect(rows).toEqual(keys.map((_, i) => (i % 3 === 0 ? [] : [row(`c${i}`)])));
    await expect(ledger.exportMany(keys, AbortSignal.abort())).rejects.toMatchObject({
      name: 'AbortError',
    });
  });

  it('an export sees rows another process sharing the directory wrote after this one', async () => {
    const mine = await ledgerAt();
    const theirs = await new CaptureLedger(mine.dir).init();
    await mine.append('r-a0', row('c1'));
    expect(await rowsOf(mine, ['r-a0'])).toEqual([[row('c1')]]);
    // Appended elsewhere: the rows this process knows are no longer the file's.
    await theirs.append('r-a0', row('c2'));
    expect(await rowsOf(mine, ['r-a0'])).toEqual([[row('c1'), row('c2')]]);
    await mine.append('r-a0', row('c3'));
    expect(await rowsOf(mine, ['r-a0'])).toEqual([[row('c1'), row('c2'), row('c3')]]);
    // Rewritten elsewhere by a restore, and deleted elsewhere.
    await theirs.importMany(new Map([['r-a0', [row('restored')]]]));
    expect(await rowsOf(mine, ['r-a0'])).toEqual([[row('restored')]]);
    await theirs.delete(['r-a0']);
    expect(await rowsOf(mine, ['r-a0'])).toEqual([[]]);
  });

  it('exportMany gives each row with the JSON the codec writes for it, also for rows another writer left', async () => {
    const ledger = await ledgerAt();
    await ledger.append('r-a0', row('c1', { logprob: -Infinity }));
    await ledger.append('r-a0', row('c2'));
    const [appended] = await ledger.exportMany(['r-a0']);
    expect(appended!.lines).toEqual(appended!.rows.map((r) => encodeJson(r)));
    // Python's spacing: the rows read back, their JSON is the codec's, not the file's.
    await writeFile(join(ledger.dir, 'p-a0.lineage.jsonl'), '{"model_call_id": "c9", "n": 1}\n');
    const [written] = await ledger.exportMany(['p-a0']);
    expect(written).toEqual({
      rows: [{ model_call_id: 'c9', n: 1 }],
      lines: ['{"model_call_id":"c9","n":1}'],
    });
  });

  it('appendedNow gives the rows and lines this process appended while each file is as it knew it, and leaves out the rest', async () => {
    const mine = await ledgerAt();
    const theirs = await new CaptureLedger(mine.dir).init();
    await mine.append('r-a0', row('c1', { logprob: -Infinity }));
    await mine.append('r-a0', row('c2'));
    // Appended by another server sharing the directory: this process does not know it.
    await theirs.append('s-a0', row('s1'));
    // Appended here, then by the other server: the file is no longer as this process knew it.
    await mine.append('t-a0', row('t1'));
    await theirs.append('t-a0', row('t2'));
    // Only read here (Python's spacing): its text is not the codec's.
    await writeFile(join(mine.dir, 'p-a0.lineage.jsonl'), '{"model_call_id": "c9"}\n');
    await mine.exportRows('p-a0');
    // Appended here and retired since.
    await mine.append('u-a0', row('u1'));
    await mine.retire(['u-a0']);
    await mine.append('v-a0', row('v1'));
    const handed = mine.appendedNow(['r-a0', 's-a0', 't-a0', 'p-a0', 'u-a0', 'none-a0']);
    expect(handed).toEqual([
      {
        key: 'r-a0',
        rows: [row('c1', { logprob: -Infinity }), row('c2')],
        lines: [encodeJson(row('c1', { logprob: -Infinity })), '{"model_call_id":"c2"}'],
        stamp: expect.any(String),
      },
    ]);
    expect(mine.appendedNow(['v-a0']).map((l) => l.key)).toEqual(['v-a0']);
    // As known, files unchecked: t-a0 too (a commit's appendedNow leaves it out, by its stamp).
    expect(mine.knownAppended().map((l) => l.key)).toEqual(['r-a0', 't-a0', 'v-a0']);
    const known = mine.knownAppended().find((l) => l.key === 't-a0')!;
    expect(mine.appendedNow(['t-a0'])).toEqual([]);
    expect(known.rows).toHaveLength(1);
  });

  it("an appended ledger's stamp changes with every append, and only then", async () => {
    const ledger = await ledgerAt();
    await ledger.append('r-a0', row('c1'));
    const stamp = () => ledger.appendedNow(['r-a0'])[0]!.stamp;
    const first = stamp();
    expect(stamp()).toBe(first);
    await ledger.append('r-a0', row('c2'));
    expect(stamp()).not.toBe(first);
  });

  it('exported rows are copies: changing them leaves the next export as the ledger is', async () => {
    const ledger = await ledgerAt();
    await ledger.append('r-a0', row('c1'));
    const [first] = await ledger.exportMany(['r-a0']);
    first!.rows.push(row('not-in-the-ledger'));
    first!.lines.push('{}');
    expect(await rowsOf(ledger, ['r-a0'])).toEqual([[row('c1')]]);
  });

  it('a retire through attempt 3,000,000 writes a constant number of files, however high the attempt', async () => {
    const ledger = await ledgerAt();
    await ledger.append('r-a2', row('c1'));
    await ledger.append('s', row('c2'));
    const before = await files(ledger);
    expect(await ledger.retireThrough([{ rollout_id: 'r', attempt: 3_000_000 }])).toEqual({
      removed: ['r-a2'],
      absent: ['r-a3000000'],
    });
    const after = await files(ledger);
    expect(after.length - before.length).toBe(2);
    expect(after).toEqual([
      'r-a2.lineage.retired',
      'r-a3000000.lineage.retired',
      'r.rollout.retired',
      's.lineage.jsonl',
    ]);
    expect(await readFile(join(ledger.dir, 'r.rollout.retired'), 'utf8')).toBe('3000000\n');
    for (const key of ['r', 'r-a2', 'r-a1234567', 'r-a3000000']) {
      expect([key, await ledger.isRetired(key)]).toEqual([key, true]);
    }
    expect(await ledger.isRetired('r-a3000001')).toBe(false);
    expect(await ledger.append('r-a3000001', row('c3'))).toBe('written');
    expect(await ledger.markStarted('r-a2999999')).toBe(false);
    expect(await ledger.isRetired('s')).toBe(false);
    // A lower retire never lowers the fence; a higher one only rewrites the rollout's fence.
    await ledger.retireThrough([{ rollout_id: 'r', attempt: 5 }]);
    expect(await ledger.isRetired('r-a2999999')).toBe(true);
    await ledger.retireThrough([{ rollout_id: 'r', attempt: MAX_ATTEMPT }]);
    // r-a3000001's ledger became its fence; the named attempt's fence is the one new file.
    expect(await files(ledger)).toEqual([
      'r-a2.lineage.retired',
      'r-a2147483647.lineage.retired',
      'r-a3000000.lineage.retired',
      'r-a3000001.lineage.retired',
      'r.rollout.retired',
      's.lineage.jsonl',
    ]);
    expect(await ledger.isRetired('r-a3000001')).toBe(true);
  });

  it('a per-key fence of the old layout still retires its key, beside rollout fences', async () => {
    const ledger = await ledgerAt();
    await writeFile(join(ledger.dir, 'r-a7.lineage.retired'), '');
    await writeFile(join(ledger.dir, 'q-a2.lineage.retired'), '{"model_call_id":"old"}\n');
    await ledger.retireThrough([{ rollout_id: 'r', attempt: 100 }]);
    expect(await files(ledger)).toEqual([
      'q-a2.lineage.retired',
      'r-a100.lineage.retired',
      'r-a7.lineage.retired',
      'r.rollout.retired',
    ]);
    for (const key of ['r-a3', 'r-a7', 'q-a2']) {
      expect([key, await ledger.isRetired(key)]).toEqual([key, true]);
      expect(await ledger.append(key, row('late'))).toBe('discarded');
      expect(await ledger.markStarted(key)).toBe(false);
    }
    for (const key of ['r-a101', 'q', 'q-a3']) {
      expect([key, await ledger.isRetired(key)]).toEqual([key, false]);
    }
    // A retire through a few attempts still writes the per-key layout, as before rollout fences.
    await ledger.retireThrough([{ rollout_id: 's', attempt: 2 }]);
    expect((await files(ledger)).filter((name) => name.startsWith('s'))).toEqual([
      's-a1.lineage.retired',
      's-a2.lineage.retired',
      's.lineage.retired',
    ]);
  });

  it('a restore lowers a rollout fence below its target, a delete below the key it deletes', async () => {
    const ledger = await ledgerAt();
    await ledger.retireThrough([{ rollout_id: 'r', attempt: 100 }]);
    await ledger.restore(new Map([['r-a3', [row('c1')]]]), [], [{ rollout_id: 'r', attempt: 2 }]);
    expect(await readFile(join(ledger.dir, 'r.rollout.retired'), 'utf8')).toBe('2\n');
    expect(await ledger.exportRows('r-a3')).toEqual([row('c1')]);
    expect([await ledger.isRetired('r-a2'), await ledger.isRetired('r-a100')]).toEqual([
      true,
      false,
    ]);
    await ledger.delete(['r-a1']);
    expect([await ledger.isRetired('r'), await ledger.isRetired('r-a1')]).toEqual([true, false]);
    await ledger.delete(['r']);
    expect(await files(ledger)).toEqual(['r-a3.lineage.jsonl']);
  });

  it('a retire keeps the retired rows in the fence and reads as retired until a delete', async () => {
    const ledger = await ledgerAt();
    await ledger.append('r', row('c1'));
    await ledger.append('r', row('c2'));
    const rows = await readFile(join(ledger.dir, 'r.lineage.jsonl'), 'utf8');
    expect(await ledger.retire(['r'])).toEqual({ removed: ['r'], absent: [] });
    expect(await readFile(join(ledger.dir, 'r.lineage.retired'), 'utf8')).toBe(rows);
    expect(await ledger.isRetired('r')).toBe(true);
    expect(await ledger.exportRows('r')).toEqual([]);
    await expect(ledger.manifest('r')).rejects.toMatchObject({ name: 'LedgerRetiredError' });
    expect(await ledger.append('r', row('late'))).toBe('discarded');
    // The fence is not a ledger: a delete finds none, and the key reads as unused again.
    expect(await ledger.delete(['r'])).toEqual({ removed: [], absent: ['r'] });
    expect(await files(ledger)).toEqual([]);
  });

  it('a restore fences the continued attempt and hands its ledger file to the replacement, with no directory sync in between', async () => {
    const ledger = await new Watched(await tempDir()).init();
    await ledger.append('r', row('dead'));
    await ledger.append('r', row('after-the-checkpoint', { long: 'x'.repeat(300) }));
    const inode = (await stat(join(ledger.dir, 'r.lineage.jsonl'))).ino;
    ledger.synced = [];
    expect(await ledger.restore(new Map([['r-a1', [row('c1')]]]), ['r'])).toEqual({
      removed: ['r'],
      absent: [],
    });
    expect(ledger.synced).toEqual([['r-a1.lineage.jsonl', 'r.lineage.retired']]);
    // The same file, holding exactly the checkpoint's rows: no inode was allocated for it.
    expect((await stat(join(ledger.dir, 'r-a1.lineage.jsonl'))).ino).toBe(inode);
    expect(await readFile(join(ledger.dir, 'r-a1.lineage.jsonl'), 'utf8')).toBe(
      `${encodeJson(row('c1'))}\n`,
    );
    expect(await ledger.exportRows('r-a1')).toEqual([row('c1')]);
    expect(await ledger.isRetired('r')).toBe(true);
  });

  it('a fence is a hard link to one shared empty file', async () => {
    const ledger = await ledgerAt();
    expect(await ledger.retire(['r', 's'])).toEqual({ removed: [], absent: ['r', 's'] });
    const shared = await stat(join(ledger.dir, '.locks', 'fence'));
    for (const key of ['r', 's']) {
      const fence = await stat(join(ledger.dir, `${key}.lineage.retired`));
      expect([key, fence.ino, fence.size]).toEqual([key, shared.ino, 0]);
    }
    expect((await stat(join(ledger.dir, '.locks', 'fence'))).nlink).toBe(3);
    expect(await ledger.isRetired('r')).toBe(true);
    // Deleting a fence leaves the others and the shared file alone.
    await ledger.delete(['r']);
    expect(await files(ledger)).toEqual(['s.lineage.retired']);
    expect(await ledger.isRetired('s')).toBe(true);
  });

  it('a fence is still made when the shared file is gone, or cannot be linked to', async () => {
    const ledger = await ledgerAt();
    await ledger.retire(['r']);
    await rm(join(ledger.dir, '.locks', 'fence'));
    await ledger.retire(['s']);
    expect((await stat(join(ledger.dir, 's.lineage.retired'))).ino).toBe(
      (await stat(join(ledger.dir, '.locks', 'fence'))).ino,
    );
    // A directory in its place cannot be linked to: the fence is a file of its own.
    await rm(join(ledger.dir, '.locks', 'fence'));
    await mkdir(join(ledger.dir, '.locks', 'fence'));
    await ledger.retire(['t']);
    const own = await stat(join(ledger.dir, 't.lineage.retired'));
    expect([own.isFile(), own.size, own.nlink]).toEqual([true, 0, 1]);
    expect(await ledger.isRetired('t')).toBe(true);
    expect(await files(ledger)).toEqual([
      'r.lineage.retired',
      's.lineage.retired',
      't.lineage.retired',
    ]);
  });

  it('a key holding both a ledger and a fence is fenced durably before its ledger goes', async () => {
    const ledger = await new Watched(await tempDir()).init();
    // What a retire that stopped between its fence and its removal leaves.
    await ledger.append('r', row('dead'));
    await writeFile(join(ledger.dir, 'r.lineage.retired'), '');
    await ledger.append('s', row('dead'));
    ledger.synced = [];
    expect(await ledger.retire(['r', 's'])).toEqual({ removed: ['r', 's'], absent: [] });
    expect(ledger.synced).toEqual([
      ['r.lineage.jsonl', 'r.lineage.retired', 's.lineage.retired'],
      ['r.lineage.retired', 's.lineage.retired'],
    ]);
    expect(await ledger.isRetired('r')).toBe(true);
  });

  it('a restore writes exactly the checkpoint rows as each target ledger, also where a longer retired ledger was', async () => {
    const ledger = await ledgerAt();
    const long = 'x'.repeat(500);
    for (const id of ['d1', 'd2', 'd3']) await ledger.append('r', row(id, { long }));
    await ledger.append('s-a1', row('dead', { long }));
    expect(
      await ledger.restore(
        new Map([
          ['r-a1', [row('c1')]],
          ['s-a2', [row('c2')]],
        ]),
        ['r', 's', 's-a1'],
      ),
    ).toEqual({ removed: ['r', 's-a1'], absent: ['s'] });
    expect(await ledger.exportRows('r-a1')).toEqual([row('c1')]);
    expect(await ledger.exportRows('s-a2')).toEqual([row('c2')]);
    expect(await files(ledger)).toEqual([
      'r-a1.lineage.jsonl',
      'r.lineage.retired',
      's-a1.lineage.retired',
      's-a2.lineage.jsonl',
      's.lineage.retired',
    ]);
  });

  it('a restore with no old ledgers still creates the targets and fences the retired keys', async () => {
    const ledger = await ledgerAt();
    const targets = new Map([
      ['r-a1', [row('c1'), row('c2')]],
      ['s-a1', [row('c3')]],
    ]);
    expect(await ledger.restore(targets, ['r', 's'])).toEqual({ removed: [], absent: ['r', 's'] });
    expect(await rowsOf(ledger, ['r-a1', 's-a1'])).toEqual([...targets.values()]);
    expect(await files(ledger)).toEqual([
      'r-a1.lineage.jsonl',
      'r.lineage.retired',
      's-a1.lineage.jsonl',
      's.lineage.retired',
    ]);
    expect(await readFile(join(ledger.dir, 'r.lineage.retired'), 'utf8')).toBe('');
  });

  it('a restore lists the directory holding its stripes, so an append racing it lands wholly after it', async () => {
    class Racing extends CaptureLedger {
      late: Promise<'written' | 'discarded'> | undefined;
      override async listByRollout(rollouts: ReadonlyMap<string, unknown>) {
        const index = await super.listByRollout(rollouts);
        this.late ??= this.append('r', row('late'));
        return index;
      }
    }
    const ledger = await new Racing(await tempDir()).init();
    expect(await ledger.restore(new Map([['r-a1', [row('c1')]]]), ['r'])).toEqual({
      removed: [],
      absent: ['r'],
    });
    expect(await ledger.late).toBe('discarded');
    expect(await files(ledger)).toEqual(['r-a1.lineage.jsonl', 'r.lineage.retired']);
  });

  it('a restore learns from its one listing whether a rollout has a fence to lower: no open per rollout', async () => {
    // A fence that appears after the listing (nothing can, with the stripes held) is not looked
    // for: the restore opens no rollout fence its listing did not show.
    class Listed extends CaptureLedger {
      override async listByRollout(rollouts: ReadonlyMap<string, unknown>) {
        const index = await super.listByRollout(rollouts);
        await writeFile(join(this.dir, 'r.rollout.retired'), '5\n');
        return index;
      }
    }
    const ledger = await new Listed(await tempDir()).init();
    await ledger.restore(new Map([['r-a1', [row('c1')]]]), []);
    expect(await readFile(join(ledger.dir, 'r.rollout.retired'), 'utf8')).toBe('5\n');
    // One the listing shows is lowered below the target.
    await ledger.restore(new Map([['r-a2', [row('c2')]]]), []);
    expect(await readFile(join(ledger.dir, 'r.rollout.retired'), 'utf8')).toBe('1\n');
  });

  it('a restore batch over 1,000 rollouts holds at most 64 stripe locks, each a directory on disk', async () => {
    let held = -1;
    class Listed extends CaptureLedger {
      // Called while the batch holds all its stripes.
      override async listByRollout(rollouts: ReadonlyMap<string, unknown>) {
        held = (await readdir(join(this.dir, '.locks'))).filter((n) => n.endsWith('.lock')).length;
        return super.listByRollout(rollouts);
      }
    }
    const ledger = await new Listed(await tempDir()).init();
    const ids = Array.from({ length: 1000 }, (_, i) => `q${i}`);
    await ledger.restore(new Map(ids.map((id) => [`${id}-a1`, [row(id)]])), []);
    expect(held).toBeGreaterThan(0);
    expect(held).toBeLessThanOrEqual(64);
    expect(await rowsOf(ledger, [`${ids[0]}-a1`])).toEqual([[row(ids[0]!)]]);
  });

  it('a fresh ledger’s first batch and every later one hold the lock of every stripe of their rollouts', async () => {
    const held: number[] = [];
    class Listed extends CaptureLedger {
      // Called while the batch holds all its stripes.
      override async listByRollout(rollouts: ReadonlyMap<string, unknown>) {
        const locks = (await readdir(join(this.dir, '.locks'))).filter((n) => n.endsWith('.lock'));
        held.push(locks.length);
        return super.listByRollout(rollouts);
      }
    }
    const ledger = await new Listed(await tempDir()).init();
    const ids = Array.from({ length: 200 }, (_, i) => `s${i}`);
    const stripes = new Set(ids.map(lockStripe)).size;
    await ledger.restore(new Map(ids.map((id) => [`${id}-a1`, [row(id)]])), []);
    await ledger.restore(new Map(ids.map((id) => [`${id}-a2`, [row(id)]])), []);
    expect(stripes).toBeGreaterThan(1);
    expect(held).toEqual([stripes, stripes]);
  });

  it('a batch takes its stripes in ascending order, waiting for a held one with none above it held', async () => {
    const ledger = await ledgerAt();
    const ids = Array.from({ length: 16 }, (_, i) => `r${i}`);
    const byStripe = [...new Map(ids.map((id) => [lockStripe(id), id]))].sort(([a], [b]) => a - b);
    const [z, x, y] = byStripe.map(([, id]) => id) as [string, string, string];
    const lockOf = (id: string) => join(ledger.dir, '.locks', `stripe-${lockStripe(id)}`);
    const options = { realpath: false };
    // Another process holds x's stripe, and will want y's after it (ascending, as ledgers do).
    const releaseX = await lockfile.lock(lockOf(x), options);
    const retire = ledger.retire([y, x, z]);
    await until(
      async () => (await lockfile.check(lockOf(z), options)) || lockfile.check(lockOf(y), options),
      'the batch to take a stripe',
    );
    // A batch waiting for x while holding y would never get it: this lock would give up.
    const retries = { retries: 100, minTimeout: 5, maxTimeout: 50 };
    const releaseY = await lockfile.lock(lockOf(y), { ...options, retries });
    await releaseY();
    await releaseX();
    expect(await retire).toEqual({ removed: [], absent: [x, y, z].sort() });
  });

  it('overlapping batches from one ledger and from two sharing a directory all finish, each ledger retired once', async () => {
    const mine = await ledgerAt();
    const theirs = await new CaptureLedger(mine.dir).init();
    const keys = Array.from({ length: 64 }, (_, i) => `k${i}`);
    for (const key of keys) await mine.append(key, row(key));
    const backwards = [...keys].reverse();
    const next = new Map(backwards.map((key) => [`${key}-a1`, [row(key)]]));
    const removals = await Promise.all([
      mine.retire(keys),
      mine.retire(backwards),
      theirs.retire(backwards),
      theirs.restore(next, backwards),
    ]);
    expect(removals.flatMap((removal) => removal.removed).sort()).toEqual([...keys].sort());
    for (const key of keys) expect(await mine.isRetired(key)).toBe(true);
    expect(await rowsOf(mine, [...next.keys()])).toEqual([...next.values()]);
  });

  it('waits for a rollout’s stripe lock another process holds', async () => {
    const ledger = await ledgerAt();
    const held = await lockfile.lock(join(ledger.dir, '.locks', `stripe-${lockStripe('r')}`), {
      realpath: false,
    });
    let written = false;
    const append = ledger.append('r', row('c1')).then((result) => {
      written = true;
      return result;
    });
    await sleep(100);
    expect(written).toBe(false);
    await held();
    expect(await append).toBe('written');
  });

  it('a stripe lock stays its holder’s while the libuv pool is busy for longer than the stale threshold', async () => {
    const staleMs = 2000;
    const ledger = await new CaptureLedger(await tempDir(), { lockStaleMs: staleMs }).init();
    const lockPath = join(ledger.dir, '.locks', `stripe-${lockStripe('r')}`);
    // Every pool thread waits on a FIFO no one writes yet, as 8,000 durable appends keep it busy.
    const fifos = Array.from({ length: Number(process.env.UV_THREADPOOL_SIZE ?? 4) }, (_, i) =>
      join(ledger.dir, `fifo-${i}`),
    );
    for (const fifo of fifos) execFileSync('mkfifo', [fifo]);
    const otherProcessTakes = () =>
      new Promise<string>((resolve, reject) => {
        // Another worker sharing the directory, with its own pool: does it find the lock stale?
        const script = `require(${JSON.stringify(require.resolve('proper-lockfile'))}).lock(${JSON.stringify(lockPath)}, { realpath: false, stale: ${staleMs} }).then(() => console.log('taken'), (e) => console.log(e.code))`;
        execFile(process.execPath, ['-e', script], (err, stdout) =>
          err ? reject(err) : resolve(stdout.trim()),
        );
      });
    const answer = await ledger.withRolloutLock('r', async () => {
      const blocked = fifos.map((fifo) => open(fifo, 'r'));
      try {
        await sleep(staleMs + 1500); // past the threshold, with heartbeats due meanwhile
        return await otherProcessTakes();
      } finally {
        // Free the pool (the release's rmdir runs there): a writer opens each FIFO.
        for (const fifo of fifos) {
          closeSync(openSync(fifo, constants.O_WRONLY | constants.O_NONBLOCK));
        }
        for (const handle of await Promise.all(blocked)) await handle.close();
      }
    });
    expect(answer).toBe('ELOCKED');
  });

  it('a held stripe lock taken over by another process is a warning, not the end of this one', async () => {
    let lost!: (err: Error) => void;
    const warned = new Promise<Error>((resolve) => (lost = resolve));
    const ledger = await new CaptureLedger(await tempDir(), { onLockLost: lost }).init();
    const lockDir = join(ledger.dir, '.locks', `stripe-${lockStripe('r')}.lock`);
    const written = await ledger.withRolloutLock('r', async () => {
      // As a process that judged it stale would: remove it and take it, with a mtime of its own.
      await rm(lockDir, { recursive: true });
      await mkdir(lockDir);
      const old = new Date(Date.now() - 60_000);
      utimesSync(lockDir, old, old);
      expect((await warned).message).toMatch(/Unable to update lock/);
      return ledger.exportRows('r');
    });
    expect(written).toEqual([]);
  });

  it('serialises appends of one rollout from many callers (one lock per rollout)', async () => {
    const ledger = await ledgerAt();
    await Promise.all(Array.from({ length: 40 }, (_, i) => ledger.append('r', row(`c${i}`))));
    const ids = (await ledger.exportRows('r')).map((r) => r.model_call_id);
    expect(new Set(ids).size).toBe(40);
    expect(await readdir(join(ledger.dir, '.locks'))).toEqual([]);
  });
});

describe('ledger rows of model calls', () => {
  it('a row is published at the first answer chunk, not at headers or keep-alives', async () => {
    const fake = await startFake(10);
    const h = await startHarness({ fake });
    await fakeCtl(h.fake, 'hold', { after_calls: 0 });
    const call = rawCall(h.url, '/ng-rollout/r/v1/chat/completions', {
      model: 'fake-model',
      stream: true,
      messages: [{ role: 'user', content: 'q' }],
    });
    await until(async () => (await fakeCalls(h.fake)).length === 1, 'the backend to see the call');
    await sleep(50); // the backend sent its headers and keep-alives by now
    expect(await h.server.ledger!.exportRows('r')).toEqual([]);
    await fakeCtl(h.fake, 'release');
    await call.finished;
    const rows = await h.server.ledger!.exportRows('r');
    expect(rows).toEqual([
      expect.objectContaining({
        response_id: 'chatcmpl-0',
        capture_key: null,
        parent_call_id: null,
        route: 'chat.completions',
        stream: true,
        request_digest: expect.stringMatching(/^[0-9a-f]{64}$/),
      }),
    ]);
    expect(typeof rows[0]!.model_call_id).toBe('string');
  });

  it('a non-streamed row carries the token counts and the response id', async () => {
    const h = await startHarness();
    const reply = await post(`${h.url}/ng-rollout/r/v1/responses`, {
      model: 'fake-model',
      input: 'q',
    });
    expect(reply.status).toBe(200);
    const [only] = await h.server.ledger!.exportRows('r');
    expect(only).toMatchObject({
      response_id: (reply.body as { id: string }).id,
      route: 'responses',
      stream: false,
      prompt_tokens: expect.any(Number),
      completion_tokens: expect.any(Number),
    });
  });

  it('a call that leaves before its response starts has no row and is not poisoned', async () => {
    const h = await startHarness();
    await fakeCtl(h.fake, 'hold', { after_calls: 0 });
    const call = rawCall(h.url, '/ng-rollout/r/v1/chat/completions', {
      model: 'fake-model',
      messages: [{ role: 'user', content: 'q' }],
    });
    await until(async () => (await fakeCalls(h.fake)).length === 1, 'the backend to see the call');
    call.abort();
    await until(() => h.server.gate.inflight === 0, 'the call to leave');
    await fakeCtl(h.fake, 'release');
    expect(await h.server.ledger!.exportRows('r')).toEqual([]);
    expect((await chat(h.url, 'r')).status).toBe(200);
    expect(await h.server.ledger!.exportRows('r')).toHaveLength(1);
  });

  it('a failed ledger write poisons the call and sends no answer', async () => {
    const h = await startHarness();
    await mkdir(join(h.captureDir, 'r.lineage.jsonl'));
    const reply = await chat(h.url, 'r');
    expect(reply.status).toBe(500);
    expect(reply.body).toMatchObject({ error: { code: 'internal_error' } });
    expect(JSON.stringify(reply.body)).not.toContain('choices');
  });

  it('untagged calls are admitted and never attributed', async () => {
    const h = await startHarness();
    expect((await chat(h.url, undefined)).status).toBe(200);
    expect((await readdir(h.captureDir)).filter((f) => f !== '.locks')).toEqual([]);
  });
});

describe('capture-ledger control routes', () => {
  const auth = { authorization: `Bearer ${TOKEN}` };
  const routes = (url: string) => `${url}/training-token-capture/control/rollouts`;

  it('serve the manifest, 410 once retired, 400 for an invalid id, 401 without the bearer', async () => {
    const h = await startHarness();
    await chat(h.url, 'r');
    const manifest = await fetch(`${routes(h.url)}/r/manifest`, { headers: auth });
    expect(manifest.status).toBe(200);
    expect(await manifest.json()).toMatchObject({
      rollout_id: 'r',
      records: [{ route: 'chat.completions' }],
      failures: [],
    });
    expect((await fetch(`${routes(h.url)}/r/manifest`)).status).toBe(401);
    expect((await fetch(`${routes(h.url)}/bad!id/manifest`, { headers: auth })).status).toBe(400);
    const retired = await post(`${routes(h.url)}/retire`, { rollout_ids: ['r'] }, auth);
    expect(retired.body).toEqual({ removed: ['r'], absent: [] });
    const gone = await fetch(`${routes(h.url)}/r/manifest`, { headers: auth });
    expect(gone.status).toBe(410);
    expect(await gone.json()).toMatchObject({
      error: { code: 'rollout_retired', detail: expect.stringContaining('is retired') },
    });
  });

  it('ledger retire and delete return 409 while a checkpoint is open and succeed after resume', async () => {
    const h = await startHarness();
    await chat(h.url, 'r');
    await control(h.url, 'prepare', { checkpoint_id: 'c1', deadline_ts: deadline() });
    for (const op of ['retire', 'delete']) {
      const refused = await post(`${routes(h.url)}/${op}`, { rollout_ids: ['r'] }, auth);
      expect(refused.status).toBe(409);
      expect(refused.body).toMatchObject({ error: { code: 'admission_closed' } });
      // after_resume: the same removal succeeds once the checkpoint is resumed (below).
      expect(refused.headers.get('x-should-retry')).toBe('true');
    }
    expect(await h.server.ledger!.exportRows('r')).toHaveLength(1);
    await control(h.url, 'resume', { checkpoint_id: 'c1', deadline_ts: deadline() });
    expect((await post(`${routes(h.url)}/delete`, { rollout_ids: ['r'] }, auth)).body).toEqual({
      removed: ['r'],
      absent: [],
    });
  });

  it('refuses an id too long to name its ledger files, or not percent-encoded, with 400', async () => {
    const h = await startHarness();
    for (const op of ['retire', 'delete']) {
      const reply = await post(`${routes(h.url)}/${op}`, { rollout_ids: ['r'.repeat(300)] }, auth);
      expect(reply).toMatchObject({ status: 400, body: { error: { code: 'invalid_rollout_id' } } });
    }
    for (const id of ['r'.repeat(300), '%ZZ']) {
      const manifest = await fetch(`${routes(h.url)}/${id}/manifest`, { headers: auth });
      expect([id, manifest.status]).toEqual([id, 400]);
      expect(await manifest.json()).toMatchObject({ error: { code: 'invalid_rollout_id' } });
    }
  });

  it('refuses a malformed removal body with 422 invalid_request', async () => {
    const h = await startHarness();
    for (const body of [
      {},
      { rollout_ids: [] },
      { rollout_ids: ['r'], extra: 1 },
      { rollout_ids: 'r' },
    ]) {
      const reply = await post(`${routes(h.url)}/retire`, body, auth);
      expect(reply.status).toBe(422);
    }
  });
});

it('a row written by a server is read back as JSON lines', async () => {
  const ledger = await ledgerAt();
  await ledger.append('r', row('c1'));
  expect(await readFile(join(ledger.dir, 'r.lineage.jsonl'), 'utf8')).toBe(
    '{"model_call_id":"c1"}\n',
  );
});
