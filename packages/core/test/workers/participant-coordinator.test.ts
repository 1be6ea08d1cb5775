/**
 * The coordinator of servers whose workers each run the kind's one-process participant: readiness
 * of all, commit and restore across the workers, claim once of restored per-request state.
 */
import { readFile } from 'node:fs/promises';
import { connect } from 'node:net';

import { jest } from '@jest/globals';

import { captureKey, episodeId, type EpisodeId } from '../../src/identity.js';
import type { JsonValue } from '../../src/json.js';
import { encodeFrame, FrameReader } from '../../src/workers/frames.js';
import { HeldRecords } from '../../src/workers/held.js';
import { ParticipantCoordinator } from '../../src/workers/participant-coordinator.js';
import {
  type CheckpointRecord,
  type Manifest,
  MANIFEST_FILE,
  participantDir,
  type RawRecord,
  RECORD_FIELDS_JSON,
  writeParticipantState,
} from '../../src/store.js';
import { TestParticipant, type TestRecord } from '../support/test-participant.js';
import { type Participants, type ParticipantsOptions, startParticipants } from './participants.js';
import { onCleanup, refusedWith, useSockets } from './sockets.js';
import { eventually, now } from './toy.js';

useSockets();
afterEach(() => jest.restoreAllMocks());

const r1 = episodeId('r1', 0);
const r2 = episodeId('r2', 0);
const r1a1 = episodeId('r1', 1);
const r2a1 = episodeId('r2', 1);
const keys = (episodes: readonly EpisodeId[]): string[] => episodes.map(captureKey).sort();

const deadline = () => ({ deadline_ts: now() + 5 });

/** Commits prepared checkpoint c1 of every episode (admission stays closed); its directory. */
async function commitC1(p: Participants): Promise<string> {
  const dir = `${p.checkpointRoot}/c1`;
  await p.plane.commit({
    checkpoint_id: 'c1',
    ...deadline(),
    checkpoint_dir: dir,
    episode_ids: null,
    stop: false,
  });
  return dir;
}

/** Two workers, each with one parked episode (payloads as given), checkpointed to a directory. */
async function checkpointOf(
  payloads: { r1?: JsonValue; r2?: JsonValue } = {},
): Promise<{ dir: string; scope: EpisodeId[] }> {
  const before = await startParticipants(2);
  const one = await before.worker(1);
  const two = await before.worker(2);
  one.participant.start(captureKey(r1), 'parked', payloads.r1 ?? { step: 1 });
  two.participant.start(captureKey(r2), 'parked', payloads.r2 ?? { step: 2 });
  expect((await before.plane.prepare({ checkpoint_id: 'c1', ...deadline() })).phase).toBe(
    'prepared',
  );
  const dir = await commitC1(before);
  return { dir, scope: [r1, r2] };
}

/** A fresh server of two workers (as after a crash) that restored `dir` and resumed. */
async function restored(
  dir: string,
  scope: EpisodeId[],
  resume = true,
  options: ParticipantsOptions = {},
): Promise<
  Participants & {
    one: Awaited<ReturnType<Participants['worker']>>;
    two: Awaited<ReturnType<Participants['worker']>>;
  }
> {
  const after = await startParticipants(2, options);
  const one = await after.worker(1);
  const two = await after.worker(2);
  await after.plane.restore({
    checkpoint_id: 'c2',
    ...deadline(),
    checkpoint_dir: dir,
    episode_ids: scope,
  });
  if (resume) await after.plane.resume({ checkpoint_id: 'c2', ...deadline() });
  return { ...after, one, two };
}

describe('participant workers: readiness', () => {
  test('ready only when every worker is: blockers of each, episodes counted over both', async () => {
    const p = await startParticipants(2);
    const one = await p.worker(1);
    const two = await p.worker(2);
    one.participant.start('a');
    two.participant.start('b', 'parked');
    const first = await p.plane.prepare({ checkpoint_id: 'c1', deadline_ts: now() + 0.3 });
    expect([first.phase, first.report.blockers, first.report.counts]).toEqual([
      'preparing',
      ['a'],
      { episodes: 2 },
    ]);
    one.participant.setState('a', 'parked');
    const second = await p.plane.prepare({ checkpoint_id: 'c1', ...deadline() });
    expect(second.phase).toBe('prepared');
    // Each worker's own counts, while the checkpoint is open.
    expect((p.plane.status().workers as { counts?: unknown }[]).map((w) => w.counts)).toEqual([
      { episodes: 1 },
      { episodes: 1 },
    ]);
  });
});

describe('participant workers: restore holds per-request state for one claim', () => {
  test('every worker installs, even with nothing to install, and the records stay with the coordinator', async () => {
    const { dir, scope } = await checkpointOf();
    const p = await restored(dir, scope);
    expect([p.one.participant.calls.install, p.two.participant.calls.install]).toEqual([1, 1]);
    expect([p.one.participant.restored.size, p.two.participant.restored.size]).toEqual([0, 0]);
    expect(keys(p.coordinator.restoredPending())).toEqual(['r1-a1', 'r2-a1']);
    expect(p.plane.status()).toMatchObject({
      restored_held: 2,
      restored_pending: ['r1-a1', 'r2-a1'],
    });
  });

  test('claim once: of two workers claiming one restored record at once, exactly one gets it', async () => {
    const { dir, scope } = await checkpointOf({ r1: { step: 7 } });
    const p = await restored(dir, scope);
    expect([p.one.side.holds('r1-a1'), p.two.side.holds('r1-a1')]).toEqual([true, true]);
    const [a, b] = await Promise.all([p.one.side.claim('r1-a1'), p.two.side.claim('r1-a1')]);
    const won = [a, b].filter((r) => r !== null) as TestRecord[];
    expect(won).toEqual([{ episode_id: r1, payload: { step: 7 } }]);
    expect(keys(p.coordinator.restoredPending())).toEqual(['r2-a1']);
    // Neither asks again: a request with nothing to claim costs no message.
    expect([p.one.side.holds('r1-a1'), p.two.side.holds('r1-a1')]).toEqual([false, false]);
  });

  test('a claim while a checkpoint is open is refused with admission_closed, and the record stays held', async () => {
    const { dir, scope } = await checkpointOf();
    const p = await restored(dir, scope, false);
    // Restored, not resumed yet: admission is still closed.
    expect((await refusedWith(p.one.side.claim('r1-a1'))).code).toBe('admission_closed');
    await p.plane.resume({ checkpoint_id: 'c2', ...deadline() });
    await p.plane.prepare({ checkpoint_id: 'c3', ...deadline() });
    expect((await refusedWith(p.two.side.claim('r1-a1'))).code).toBe('admission_closed');
    expect(p.one.side.holds('r1-a1')).toBe(true);
    await p.plane.resume({ checkpoint_id: 'c3', ...deadline() });
    expect(await p.one.side.claim('r1-a1')).not.toBeNull();
  });

  test("a claim's reply reaches its worker before the next checkpoint's close", async () => {
    const { dir, scope } = await checkpointOf();
    const p = await restored(dir, scope);
    // A worker on a raw socket, so the order of frames on the wire is what is checked.
    const socket = connect(p.socketPath);
    await new Promise<void>((resolve) => socket.once('connect', () => resolve()));
    onCleanup(() => void socket.destroy());
    const reader = new FrameReader();
    const seen: string[] = [];
    socket.on('data', (chunk: Buffer) => {
      for (const frame of reader.push(chunk) as {
        reply_to?: number;
        id?: number;
        kind?: string;
      }[]) {
        if (frame.reply_to === 2) seen.push('claim reply');
        if (frame.kind === 'close') {
          seen.push('close');
          socket.write(
            encodeFrame({
              reply_to: frame.id,
              ok: true,
              body: { seq: 1, report: { gate: {}, extra: {} } },
            }),
          );
        }
      }
    });
    socket.write(encodeFrame({ id: 1, kind: 'join', body: { index: 3, pid: 1, extra: {} } }));
    await eventually(() => p.coordinator.workers().length === 3);
    // The checkpoint closes admission as soon as the claim has taken the record.
    const claim = HeldRecords.prototype.claim;
    jest.spyOn(HeldRecords.prototype, 'claim').mockImplementationOnce(function (
      this: HeldRecords,
      key: string,
    ) {
      const record = claim.call(this, key);
      queueMicrotask(
        () =>
          void p.coordinator.closeAdmission({
            checkpointId: 'c3',
            deadlineTs: now() + 5,
            carriedRestarts: new Set(),
          }),
      );
      return record;
    });
    socket.write(encodeFrame({ id: 2, kind: 'claim', body: { key: 'r1-a1' } }));
    await eventually(() => seen.length === 2);
    expect(seen).toEqual(['claim reply', 'close']);
  });
});

describe('participant workers: the next commit, retire and pending attempts', () => {
  test('an unclaimed restored record is exported again as its next attempt, only when the scope names it', async () => {
    const { dir, scope } = await checkpointOf({ r1: { step: 1 }, r2: { step: 2 } });
    const p = await restored(dir, scope);
    await p.plane.prepare({ checkpoint_id: 'c3', ...deadline() });
    expect(await p.coordinator.export([r1a1])).toEqual([
      { episode_id: r1a1, payload: { step: 1 } },
    ]);
    expect(keys((await p.coordinator.export(null)).map((r) => r.episode_id))).toEqual([
      'r1-a1',
      'r2-a1',
    ]);
    expect(await p.coordinator.export([r1])).toEqual([]);
    // The commit frees the one it leaves out.
    await p.plane.commit({
      checkpoint_id: 'c3',
      ...deadline(),
      checkpoint_dir: `${p.checkpointRoot}/c3`,
      episode_ids: [r1a1],
      stop: false,
    });
    expect(keys(p.coordinator.restoredPending())).toEqual(['r1-a1']);
  });

  test('a retire drops the held records of the rollout up to the retired attempt', async () => {
    const { dir, scope } = await checkpointOf();
    const p = await restored(dir, scope);
    await p.plane.retire({ checkpoint_id: 'x', ...deadline(), episode_ids: [r1] });
    expect(keys(p.coordinator.restoredPending())).toEqual(['r1-a1', 'r2-a1']);
    await p.plane.retire({ checkpoint_id: 'x', ...deadline(), episode_ids: [r1a1] });
    expect(keys(p.coordinator.restoredPending())).toEqual(['r2-a1']);
    expect(await p.one.side.claim('r1-a1')).toBeNull();
  });

  test("restoredPending is the held records and each worker's own restored attempts; a commit frees a worker's", async () => {
    const { dir, scope } = await checkpointOf({ r2: { placed: true, worker: 2 } });
    const p = await restored(dir, scope);
    expect(keys(p.two.participant.restoredPending())).toEqual(['r2-a1']);
    expect(keys(p.coordinator.restoredPending())).toEqual(['r1-a1', 'r2-a1']);
    await p.plane.prepare({ checkpoint_id: 'c3', ...deadline() });
    await p.plane.commit({
      checkpoint_id: 'c3',
      ...deadline(),
      checkpoint_dir: `${p.checkpointRoot}/c3`,
      episode_ids: [r1a1],
      stop: false,
    });
    expect(p.two.participant.calls.deleteRestored).toEqual(['r2-a1']);
    expect(keys(p.coordinator.restoredPending())).toEqual(['r1-a1']);
  });

  test('a restore whose close of admission fails on one of several workers reopens admission', async () => {
    const { dir, scope } = await checkpointOf();
    const p = await startParticipants(2);
    const one = await p.worker(1);
    const two = await p.worker(2);
    two.participant.closeAdmissionError = new Error('worker 2 cannot close');
    const restore = p.plane.restore({
      checkpoint_id: 'c2',
      ...deadline(),
      checkpoint_dir: dir,
      episode_ids: scope,
    });
    expect((await refusedWith(restore)).code).toBe('checkpoint_error');
    await eventually(
      () =>
        p.coordinator.accepting && one.participant.admissionOpen && two.participant.admissionOpen,
    );
    expect([one.side.gate.isOpen, two.side.gate.isOpen]).toEqual([true, true]);
  });

  test('a record no request claims, with no placement for it, is refused with a typed error', async () => {
    const coordinator = new ParticipantCoordinator<TestRecord>({
      kind: 'environment',
      instance: 'env',
      expectedWorkers: 1,
      records: {
        validateRecord: (record) => record as unknown as TestRecord,
        claimedByRequest: () => false,
      },
    });
    const err = await refusedWith(
      coordinator.install([{ episode_id: r2a1, payload: null }], [r2a1]),
    );
    expect(err.code).toBe('checkpoint_error');
    expect(err.detail).toContain('r2-a1');
  });
});

/** A worker participant that records each line a restore hands it to read raw. */
class RawReadingParticipant extends TestParticipant {
  readonly rawLines: string[] = [];

  validateRawRecord(record: RawRecord, key: string): TestRecord {
    this.rawLines.push(record.bytes.toString());
    return this.validateRecord(record.decode(), key);
  }
}

describe('participant workers: an install hands records as the checkpoint holds them', () => {
  test("a placed record reaches its worker as its line in the checkpoint, read there as the store reads one, never re-encoded from the coordinator's copy", async () => {
    const payload = { placed: true, worker: 2, logprob: -Infinity, tokens: [2n ** 64n + 1n] };
    const before = await startParticipants(1);
    (await before.worker(1)).participant.start(captureKey(r1), 'parked', payload);
    expect((await before.plane.prepare({ checkpoint_id: 'c1', ...deadline() })).phase).toBe(
      'prepared',
    );
    const dir = await commitC1(before);
    const file = participantDir(dir, 'environment', 'env');
    const manifest = JSON.parse(await readFile(`${file}/${MANIFEST_FILE}`, 'utf8')) as Manifest;
    const line = (await readFile(`${file}/${manifest.records_file}`, 'utf8')).trimEnd();

    // The coordinator's copy differs from the line: re-encoding it would hand the worker that.
    const coordinatorCopy = { placed: true, worker: 2, copy: "the coordinator's" };
    const { one, two } = await restored(dir, [r1], false, {
      records: {
        validateRecord: () => {
          throw new Error('the coordinator decoded a record whole');
        },
        validateRawRecord: (record) => ({
          episode_id: record.episode_id,
          payload: coordinatorCopy,
        }),
        claimedByRequest: () => false,
      },
      participant: () => new RawReadingParticipant('env'),
    });
    const reading = (w: typeof one) => w.participant as RawReadingParticipant;
    expect([reading(one).rawLines, reading(two).rawLines]).toEqual([[], [line]]);
    expect(two.participant.restored.get(captureKey(r1a1))?.payload).toEqual(payload);
  });
});

describe('participant workers: a commit takes its records as the bytes the workers encoded', () => {
  /** A payload only the faithful codec writes: NaN, -Infinity, an integer beyond 2^53. */
  const faithful = { logprob: -Infinity, score: NaN, tokens: [2n ** 64n + 1n, 3], text: 'é"\n' };

  /** Two workers, each with a parked episode, prepared for checkpoint c1. */
  async function twoParked(): Promise<Participants & { records: () => Promise<TestRecord[]> }> {
    const p = await startParticipants(2);
    const one = await p.worker(1);
    const two = await p.worker(2);
    one.participant.start(captureKey(r1), 'parked', { step: 1, values: faithful });
    two.participant.start(captureKey(r2), 'parked', faithful);
    expect((await p.plane.prepare({ checkpoint_id: 'c1', ...deadline() })).phase).toBe('prepared');
    // What each worker's participant exports, as one process would hand them to its store.
    const signal = new AbortController().signal;
    const records = async () => [
      ...(await one.participant.export(null, signal)),
      ...(await two.participant.export(null, signal)),
    ];
    return { ...p, records };
  }

  /** The bytes of the records file a commit wrote under `checkpointDir`. */
  async function recordsFile(checkpointDir: string): Promise<Buffer> {
    const dir = participantDir(checkpointDir, 'environment', 'env');
    const manifest = JSON.parse(await readFile(`${dir}/${MANIFEST_FILE}`, 'utf8')) as Manifest;
    return readFile(`${dir}/${manifest.records_file}`);
  }

  test("the records file of a two-worker commit is byte for byte one process's, faithful values included", async () => {
    const p = await twoParked();
    const dir = await commitC1(p);
    const oneProcess = `${p.checkpointRoot}/one-process`;
    await writeParticipantState({
      checkpointDir: oneProcess,
      kind: 'environment',
      instance: 'env',
      checkpointId: 'c1',
      records: await p.records(),
    });
    const [workers, alone] = [await recordsFile(dir), await recordsFile(oneProcess)];
    expect(workers.toString()).toContain(
      '"logprob":-Infinity,"score":NaN,"tokens":[18446744073709551617,3]',
    );
    expect(workers.equals(alone)).toBe(true);
  });

  test("the coordinator decodes and checks none of its workers' records: each reaches the store as their bytes", async () => {
    const p = await twoParked();
    const validated = jest.spyOn(TestParticipant.prototype, 'validateRecord');
    const exported = jest.spyOn(p.coordinator, 'export');
    await commitC1(p);
    expect(validated).not.toHaveBeenCalled();
    const records = (await exported.mock.results[0]!.value) as CheckpointRecord[];
    expect(records.map((r) => [captureKey(r.episode_id), Object.keys(r)])).toEqual([
      ['r1', ['episode_id']],
      ['r2', ['episode_id']],
    ]);
    for (const record of records) {
      expect(record[RECORD_FIELDS_JSON]).toEqual([expect.any(Uint8Array)]);
    }
  });
});
