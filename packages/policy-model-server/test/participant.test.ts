import { existsSync } from 'node:fs';
import { readdir, readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';

import { encodeJson, type JsonObject, parseCaptureKey } from '@ckpt-gym/core/protocol';
import { RECORD_FIELDS_JSON, writeParticipantState } from '@ckpt-gym/core/server';
import { deadline, episodes, until } from '@ckpt-gym/testing';
import { afterEach, describe, expect, it } from '@jest/globals';

import {
  CaptureLedger,
  type ModelRecord,
  PolicyGate,
  PolicyParticipant,
  stampRows,
} from '../src/index.js';
import {
  chat,
  cleanup,
  control,
  fakeCalls,
  fakeCtl,
  type Harness,
  startFake,
  startHarness,
  tempDir,
} from './support.js';

afterEach(cleanup);

/** prepare → commit (scope) → resume; returns the commit reply. */
async function checkpoint(h: Harness, id: string, dir: string, scope: string[]) {
  const prepared = await control(h.url, 'prepare', { checkpoint_id: id, deadline_ts: deadline() });
  expect(prepared.body).toMatchObject({ phase: 'prepared' });
  const committed = await control(h.url, 'commit', {
    checkpoint_id: id,
    deadline_ts: deadline(),
    checkpoint_dir: dir,
    episode_ids: episodes(...scope),
  });
  await control(h.url, 'resume', { checkpoint_id: id, deadline_ts: deadline() });
  return committed;
}

async function records(dir: string): Promise<Record<string, unknown>[]> {
  const participantDir = join(dir, 'gym', 'model', 'policy');
  const file = (await readdir(participantDir)).find((f) => f.startsWith('records'));
  const text = await readFile(join(participantDir, file!), 'utf8');
  return text
    .split('\n')
    .filter(Boolean)
    .map((line) => JSON.parse(line) as Record<string, unknown>);
}

function restore(h: Harness, id: string, dir: string, scope: string[]) {
  return control(h.url, 'restore', {
    checkpoint_id: id,
    deadline_ts: deadline(),
    checkpoint_dir: dir,
    episode_ids: episodes(...scope),
  });
}

/**
 * Restores a checkpoint whose one record (episode r) holds `rows` as these texts, past
 * DEFER_DECODE_MIN_BYTES when a row is padded; returns the text of r-a1's ledger file.
 */
async function restoreRowTexts(rows: readonly string[]) {
  const dir = await tempDir();
  await writeParticipantState({
    checkpointDir: dir,
    kind: 'model',
    instance: 'policy',
    checkpointId: 'c1',
    records: [
      {
        episode_id: { rollout_id: 'r', attempt: 0 },
        [RECORD_FIELDS_JSON]: [`"rows":[${rows.join(', ')}],"generation_cuts":[]`],
      },
    ],
  });
  const captureDir = await tempDir();
  const h = await startHarness({ fake: await startFake(), captureDir });
  expect((await restore(h, 'c1', dir, ['r'])).body).toMatchObject({ restored: ['r-a1'] });
  // Whatever the text, the ledger holds the rows as stamped after decoding.
  expect(await h.server.ledger!.exportRows('r-a1')).toEqual(
    stampRows(
      rows.map((r) => JSON.parse(r) as JsonObject),
      'r',
    ),
  );
  return readFile(join(captureDir, 'r-a1.lineage.jsonl'), 'utf8');
}

const ls = async (dir: string) => (await readdir(dir)).filter((f) => f !== '.locks').sort();

describe('commit', () => {
  it('a commit without episode_ids is refused', async () => {
    const h = await startHarness();
    await control(h.url, 'prepare', { checkpoint_id: 'c1', deadline_ts: deadline() });
    const reply = await control(h.url, 'commit', {
      checkpoint_id: 'c1',
      deadline_ts: deadline(),
      checkpoint_dir: await tempDir(),
    });
    expect(reply.status).toBe(409);
    expect(reply.body).toMatchObject({ error: { detail: expect.stringContaining('episode_ids') } });
  });

  it('exports each in-scope episode’s ledger rows, leaving out undelivered calls, and replies staging keys', async () => {
    const h = await startHarness();
    expect((await chat(h.url, 'r')).status).toBe(200);
    expect((await chat(h.url, 'out-of-scope')).status).toBe(200);
    await fakeCtl(h.fake, 'hold', { after_calls: 2 });
    const held = chat(h.url, 's');
    await until(async () => (await fakeCalls(h.fake)).length === 3, 'the held call');
    const dir = await tempDir();
    const committed = await checkpoint(h, 'c1', dir, ['r', 's', 't']);
    expect(committed.body).toMatchObject({
      phase: 'committed',
      episode_ids: ['r'],
      // The worker staged r's call under `<capture key>/<model call id>`.
      staging_keys: [expect.stringMatching(/^r\/[0-9a-f]{32}$/)],
      staging_keys_by_episode: { r: [expect.stringMatching(/^r\/[0-9a-f]{32}$/)] },
    });
    const [record] = await records(dir);
    expect(record).toMatchObject({
      episode_id: { rollout_id: 'r', attempt: 0 },
      rows: [{ route: 'chat.completions' }],
      generation_cuts: [],
    });
    await fakeCtl(h.fake, 'release');
    expect((await held).status).toBe(200);
  });

  it('an exported record carries its rows as the JSON the ledger took when each was appended', async () => {
    const h = await startHarness();
    expect((await chat(h.url, 'r')).status).toBe(200);
    const participant = h.server.participant!;
    const [first] = await participant.export(episodes('r'), new AbortController().signal);
    const pieces = first![RECORD_FIELDS_JSON]?.join('');
    expect(pieces).toBe(
      encodeJson({ rows: first!.rows, generation_cuts: first!.generation_cuts }).slice(1, -1),
    );
    // The text is the ledger's, not encoded from the exported rows: changing one in place (which
    // nothing may do) does not change the next export's text.
    first!.rows[0]!.route = 'changed';
    const [again] = await participant.export(episodes('r'), new AbortController().signal);
    expect(again![RECORD_FIELDS_JSON]?.join('')).toBe(pieces);
  });

  it('commit replies list staging keys, flat and per episode', () => {
    const participant = new PolicyParticipant('policy', new PolicyGate(), undefined);
    const rec = (key: string, rows: object[], cuts: object[] = []): ModelRecord => ({
      episode_id: { rollout_id: key, attempt: 0 },
      rows: rows as ModelRecord['rows'],
      generation_cuts: cuts as ModelRecord['generation_cuts'],
    });
    expect(
      participant.commitReplyExtra([
        rec('r', [{ staging_key: 'r/c1' }, { failure_reason: 'x' }]),
        rec('s', [], [{ continuation: { staging_keys: ['__generation_cut__/c2'] } }]),
      ]),
    ).toEqual({
      staging_keys: ['__generation_cut__/c2', 'r/c1'],
      staging_keys_by_episode: { r: ['r/c1'], s: ['__generation_cut__/c2'] },
    });
  });

  it('commit replies list each record’s keys sorted once, and the flat list every key sorted once', () => {
    const participant = new PolicyParticipant('policy', new PolicyGate(), undefined);
    const rec = (key: string, rows: object[], cuts: object[] = []): ModelRecord => ({
      episode_id: parseCaptureKey(key),
      rows: rows as ModelRecord['rows'],
      generation_cuts: cuts as ModelRecord['generation_cuts'],
    });
    // A restored attempt's record carries its predecessor's rows: a key under two episodes.
    const reply = participant.commitReplyExtra([
      rec(
        'r-a1',
        [{ staging_key: 'r/c2' }, { staging_key: 'r/c1' }],
        [{ continuation: { staging_keys: ['r/c2', '__generation_cut__/c3'] } }],
      ),
      rec('r', [{ staging_key: 'r/c1' }, { staging_key: '' }]),
      rec('q', [{ staging_key: 'q/c9' }]),
    ]);
    expect(reply).toEqual({
      staging_keys: ['__generation_cut__/c3', 'q/c9', 'r/c1', 'r/c2'],
      staging_keys_by_episode: {
        'r-a1': ['__generation_cut__/c3', 'r/c1', 'r/c2'],
        r: ['r/c1'],
        q: ['q/c9'],
      },
    });
  });
});

describe('restore', () => {
  it('a model server that has served any call refuses to restore', async () => {
    const h = await startHarness();
    await chat(h.url, undefined);
    const reply = await restore(h, 'c1', await tempDir(), ['r']);
    expect(reply.status).toBe(409);
    expect(reply.body).toMatchObject({
      error: { detail: expect.stringContaining('served calls') },
    });
  });

  it('imports rows under the next attempt, stamped with the key that staged them, and retires attempts 0..N', async () => {
    const fake = await startFake();
    const captureDir = await tempDir();
    const first = await startHarness({ fake, captureDir });
    await chat(first.url, 'r-a1');
    const dir = await tempDir();
    await checkpoint(first, 'c1', dir, ['r-a1']);
    await first.close();

    const second = await startHarness({ fake, captureDir });
    const restored = await restore(second, 'c2', dir, ['r-a1']);
    expect(restored.body).toMatchObject({ phase: 'restored', restored: ['r-a2'] });
    const rows = await second.server.ledger!.exportRows('r-a2');
    expect(rows).toEqual([
      expect.objectContaining({ capture_key: 'r-a1', route: 'chat.completions' }),
    ]);
    expect(await ls(captureDir)).toEqual([
      'r-a1.lineage.retired',
      'r-a2.lineage.jsonl',
      'r.lineage.retired',
    ]);
  });

  it('a restore writes each ledger row as the checkpoint’s text, the stamp appended, not decoded and encoded again', async () => {
    // Rows as another writer spaced them: what the ledger gets shows whether they were re-encoded.
    // Past DEFER_DECODE_MIN_BYTES: a smaller record is decoded whole and its rows encoded again.
    const pad = 'x'.repeat(20_000);
    const rows = [
      `{"model_call_id": "m1", "route": "chat.completions", "pad": "${pad}"}`,
      '{"failure_reason": "x"}',
      '{"model_call_id": "m3", "capture_key": "q"}',
      '{}',
    ];
    const ledgerText = await restoreRowTexts(rows);
    expect(ledgerText).toBe(
      [
        `{"model_call_id": "m1", "route": "chat.completions", "pad": "${pad}","capture_key":"r"}`,
        '{"failure_reason": "x"}',
        '{"model_call_id": "m3", "capture_key": "q"}',
        '{"capture_key":"r"}',
        '',
      ].join('\n'),
    );
  });

  it('a chain of restores keeps each row’s original stamp', () => {
    const rows = stampRows(
      [{ model_call_id: 'a', capture_key: 'r' }, { model_call_id: 'b' }, { failure_reason: 'x' }],
      'r-a1',
    );
    expect(rows).toEqual([
      { model_call_id: 'a', capture_key: 'r' },
      { model_call_id: 'b', capture_key: 'r-a1' },
      { failure_reason: 'x' },
    ]);
  });

  it('restoring again clears a dead execution of an in-scope episode without a model record', async () => {
    const fake = await startFake();
    const captureDir = await tempDir();
    const first = await startHarness({ fake, captureDir });
    const dir = await tempDir();
    await checkpoint(first, 'c1', dir, ['q']);
    await first.close();
    for (const name of [
      'q-a1.lineage.jsonl',
      'q-a2.lineage.retired',
      'q-a1.tokens.jsonl',
      'q1-a1.lineage.jsonl',
    ]) {
      await writeFile(join(captureDir, name), '{"model_call_id":"dead"}\n');
    }
    const second = await startHarness({ fake, captureDir });
    expect((await restore(second, 'c2', dir, ['q'])).status).toBe(200);
    expect(await ls(captureDir)).toEqual(['q.lineage.retired', 'q1-a1.lineage.jsonl']);
  });

  it('the first admitted call of a restored attempt creates its started marker; a commit leaving it out keeps its ledger, and deletes an unstarted one without a fence', async () => {
    const fake = await startFake();
    const captureDir = await tempDir();
    const first = await startHarness({ fake, captureDir });
    await chat(first.url, 'r');
    await chat(first.url, 's');
    const dir = await tempDir();
    await checkpoint(first, 'c1', dir, ['r', 's']);
    await first.close();

    const second = await startHarness({ fake, captureDir });
    await restore(second, 'c2', dir, ['r', 's']);
    expect(second.server.participant!.restoredPending().map((e) => e.rollout_id)).toEqual([
      'r',
      's',
    ]);
    await control(second.url, 'resume', { checkpoint_id: 'c2', deadline_ts: deadline() });
    expect((await chat(second.url, 'r-a1')).status).toBe(200);
    expect(existsSync(join(captureDir, 'r-a1.lineage.started'))).toBe(true);
    expect(second.server.participant!.restoredPending().map((e) => e.rollout_id)).toEqual(['s']);

    const committed = await checkpoint(second, 'c3', await tempDir(), []);
    expect(committed.status).toBe(200);
    expect(await second.server.ledger!.exportRows('r-a1')).toHaveLength(2);
    expect(await ls(captureDir)).toEqual([
      'r-a1.lineage.jsonl',
      'r-a1.lineage.started',
      'r.lineage.retired',
      's.lineage.retired',
    ]);
    expect(second.server.participant!.restoredPending()).toEqual([]);
  });

  it('a failed delete of a restored ledger keeps the attempt pending, and the next attempt deletes it', async () => {
    class FlakyLedger extends CaptureLedger {
      failures = 1;
      override async deleteUnstarted(key: string): Promise<boolean> {
        if (this.failures-- > 0) throw new Error('disk says no');
        return super.deleteUnstarted(key);
      }
    }
    const ledger = await new FlakyLedger(await tempDir()).init();
    const participant = new PolicyParticipant('policy', new PolicyGate(), ledger);
    await participant.install(
      [
        {
          episode_id: { rollout_id: 'r', attempt: 0 },
          rows: [{ model_call_id: 'c1' }],
          generation_cuts: [],
        },
      ],
      episodes('r'),
    );
    await expect(participant.deleteRestored({ rollout_id: 'r', attempt: 1 })).rejects.toThrow(
      'disk says no',
    );
    expect(participant.restoredPending()).toEqual([{ rollout_id: 'r', attempt: 1 }]);
    await participant.deleteRestored({ rollout_id: 'r', attempt: 1 });
    expect(participant.restoredPending()).toEqual([]);
    expect(await ls(ledger.dir)).toEqual(['r.lineage.retired']);
  });
});

describe('retire', () => {
  it('a retire of attempt 3,000,000 creates a constant number of files; attempts up to it are refused, 3,000,001 is served', async () => {
    const h = await startHarness();
    await chat(h.url, 'r');
    await chat(h.url, 'r-a7');
    const before = await ls(h.captureDir);
    expect(before).toEqual(['r-a7.lineage.jsonl', 'r.lineage.jsonl']);
    const retired = await control(h.url, 'retire', {
      checkpoint_id: 'c0',
      deadline_ts: deadline(),
      episode_ids: episodes('r-a3000000'),
    });
    expect(retired.status).toBe(200);
    // The ledgers that were there became fences; the named attempt and the rollout got one each.
    expect(await ls(h.captureDir)).toEqual([
      'r-a3000000.lineage.retired',
      'r-a7.lineage.retired',
      'r.lineage.retired',
      'r.rollout.retired',
    ]);
    for (const key of ['r-a2999999', 'r-a3000000']) {
      expect((await chat(h.url, key)).body).toMatchObject({ error: { code: 'stale_attempt' } });
    }
    expect((await chat(h.url, 'r-a3000001')).status).toBe(200);
    // What another server sharing the directory reads: attempts up to 3,000,000 retired.
    const shared = await new CaptureLedger(h.captureDir).init();
    for (const key of ['r', 'r-a1', 'r-a2999999', 'r-a3000000']) {
      expect([key, await shared.isRetired(key)]).toEqual([key, true]);
      await expect(shared.manifest(key)).rejects.toMatchObject({ code: 'rollout_retired' });
      expect(await shared.append(key, { model_call_id: 'late' })).toBe('discarded');
    }
    expect(await shared.isRetired('r-a3000001')).toBe(false);
    expect(await shared.exportRows('r-a3000001')).toHaveLength(1);
  });

  it('a retire naming attempt 2^32 is refused 422 invalid_request, not a 409 checkpoint_error', async () => {
    const h = await startHarness();
    const reply = await control(h.url, 'retire', {
      checkpoint_id: 'c0',
      deadline_ts: deadline(),
      episode_ids: [{ rollout_id: 'r', attempt: 2 ** 32 }],
    });
    expect([reply.status, reply.body]).toEqual([
      422,
      { error: expect.objectContaining({ code: 'invalid_request' }) },
    ]);
    expect(await ls(h.captureDir)).toEqual([]);
  });

  it('a retire stops a running generation before it replies, and retires the ledgers of attempts 0 to N but not N+1', async () => {
    const h = await startHarness();
    await chat(h.url, 'r');
    await chat(h.url, 'r-a2');
    await fakeCtl(h.fake, 'hold', { after_calls: 2 });
    const running = chat(h.url, 'r-a1');
    await until(async () => (await fakeCalls(h.fake)).length === 3, 'the running call');
    const retired = await control(h.url, 'retire', {
      checkpoint_id: 'c0',
      deadline_ts: deadline(),
      episode_ids: episodes('r-a1'),
    });
    expect(retired.status).toBe(200);
    expect(h.server.gate.inflight).toBe(0);
    expect((await running).status).toBe(409);
    expect(await ls(h.captureDir)).toEqual([
      'r-a1.lineage.retired',
      'r-a2.lineage.jsonl',
      'r.lineage.retired',
    ]);
  });

  it('a call waiting at closed admission is refused stale_attempt at once when its attempt is retired, and stays refused after forget and resume', async () => {
    const fake = await startFake();
    const captureDir = await tempDir();
    const first = await startHarness({ fake, captureDir });
    const dir = await tempDir();
    await checkpoint(first, 'c1', dir, []);
    const second = await startHarness({ fake, captureDir });
    await restore(second, 'c2', dir, ['r']);
    const waiting = chat(second.url, 'r-a1');
    const survivor = chat(second.url, 'r-a3');
    await until(() => second.server.gate.waitingCount === 2, 'the calls to wait');
    const retired = await control(second.url, 'retire', {
      checkpoint_id: 'c2',
      deadline_ts: deadline(),
      episode_ids: episodes('r-a2'),
    });
    expect(retired.status).toBe(200);
    const refused = await waiting;
    expect(refused.status).toBe(409);
    expect(refused.body).toMatchObject({ error: { code: 'stale_attempt' } });
    await control(second.url, 'forget', {
      checkpoint_id: 'c2',
      deadline_ts: deadline(),
      rollout_ids: ['r'],
    });
    await control(second.url, 'resume', { checkpoint_id: 'c2', deadline_ts: deadline() });
    expect((await survivor).status).toBe(200);
    expect((await fakeCalls(fake)).map((c) => c.capture_key)).toEqual(['r-a3']);
  });

  it('the same with a retire cut short by its deadline: the waiting call is still refused after forget and resume', async () => {
    const fake = await startFake();
    const captureDir = await tempDir();
    const first = await startHarness({ fake, captureDir });
    const dir = await tempDir();
    await checkpoint(first, 'c1', dir, []);
    const second = await startHarness({ fake, captureDir });
    await restore(second, 'c2', dir, ['r']);
    const waiting = chat(second.url, 'r-a1');
    await until(() => second.server.gate.waitingCount === 1, 'the call to wait');
    const retired = await control(second.url, 'retire', {
      checkpoint_id: 'c2',
      deadline_ts: Date.now() / 1000 - 1,
      episode_ids: episodes('r-a1'),
    });
    expect(retired.status).toBe(409);
    await control(second.url, 'forget', {
      checkpoint_id: 'c2',
      deadline_ts: deadline(),
      rollout_ids: ['r'],
    });
    await control(second.url, 'resume', { checkpoint_id: 'c2', deadline_ts: deadline() });
    const refused = await waiting;
    expect(refused.body).toMatchObject({ error: { code: 'stale_attempt' } });
    expect(second.server.gate.waitingCount).toBe(0);
    expect(await fakeCalls(fake)).toEqual([]);
  });
});
