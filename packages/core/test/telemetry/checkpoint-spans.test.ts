/**
 * A checkpoint's spans through real HTTP: four participants (one per kind) served by
 * `createGymApp`, driven by coordination over core's got clients, traced into an in-memory
 * exporter. One checkpoint is one trace: the controller's operation, its prepare stages, and
 * every participant's operation with its slow steps as children.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import type { ReadableSpan } from '@opentelemetry/sdk-trace-base';

import {
  commit,
  createParticipants,
  type Participants,
  prepare,
  restore,
  resume,
  retire,
} from '../../src/coordination.js';
import { createHttpClients, type HttpClients } from '../../src/http-client.js';
import { episodeId } from '../../src/identity.js';
import { PREPARE_ORDER, type ParticipantKind } from '../../src/participant.js';
import { createGymApp, listen, type ListeningServer } from '../../src/server.js';
import {
  ATTR_BYTES,
  ATTR_CHECKPOINT_ID,
  ATTR_INSTANCE,
  ATTR_KIND,
  ATTR_OUTCOME,
  ATTR_PHASE,
  ATTR_PREPARED,
  ATTR_RECORDS,
  ATTR_SOURCE_ID,
  ATTR_STAGE,
} from '../../src/telemetry/checkpoint-spans.js';
import { MemoryLogger, TestParticipant } from '../support/test-participant.js';
import {
  childrenOf,
  named,
  one,
  parentOf,
  traceId,
  useInMemoryTracing,
  waitForSpans,
} from './spans.js';

useInMemoryTracing();

const TOKEN = 'span-token';
let root = '';
let clients: HttpClients;
const servers: ListeningServer[] = [];
const planes: { dispose(): void }[] = [];

beforeEach(async () => {
  root = await mkdtemp(join(tmpdir(), 'ckpt-spans-'));
  clients = createHttpClients();
});

afterEach(async () => {
  for (const plane of planes.splice(0)) plane.dispose();
  await Promise.all(servers.splice(0).map((s) => s.close()));
  clients.close();
  await rm(root, { recursive: true, force: true });
});

/** One participant per kind, each with one parked episode, listening on a free port. */
async function stack(): Promise<{ participants: Participants; members: TestParticipant[] }> {
  const members: TestParticipant[] = [];
  const urls: string[] = [];
  for (const kind of PREPARE_ORDER) {
    const participant = new TestParticipant(`${kind}-1`, kind as ParticipantKind);
    participant.start('ep-1', 'parked', { kind });
    const gym = createGymApp({
      name: participant.instance,
      kind: kind as ParticipantKind,
      checkpoint: { enabled: true, controlAuthToken: TOKEN, leaseGraceSeconds: 60 },
      participant,
      logger: new MemoryLogger(),
    });
    planes.push(gym.plane!);
    const server = await listen(gym.finish(), 0, '127.0.0.1');
    servers.push(server);
    members.push(participant);
    urls.push(server.url);
  }
  const participants = createParticipants(
    members.map((m, i) => ({ server: m.instance, kind: m.kind, url: urls[i]! })),
    { token: TOKEN, clients },
  );
  return { participants, members };
}

const deadline = () => Date.now() / 1000 + 30;

function names(spans: readonly ReadableSpan[]): string[] {
  return spans.map((s) => s.name).sort();
}

describe('checkpoint spans', () => {
  it('prepare is one controller span with a child per stage, each holding its participant’s prepare', async () => {
    const { participants } = await stack();
    const result = await prepare(participants, 'ck-1', deadline());
    expect(result.prepared).toBe(true);
    await waitForSpans('gym.checkpoint.prepare', 4);

    const controller = one('gym.checkpoint.coordinate.prepare');
    expect(controller.attributes).toMatchObject({
      [ATTR_CHECKPOINT_ID]: 'ck-1',
      [ATTR_PREPARED]: true,
    });
    expect(parentOf(controller)).toBeUndefined();
    const stages = childrenOf(controller);
    expect(names(stages)).toEqual(
      PREPARE_ORDER.map((kind) => `gym.checkpoint.coordinate.prepare.${kind}`).sort(),
    );
    // Stage by stage, in prepare order.
    const starts = PREPARE_ORDER.map((kind) =>
      hrMs(one(`gym.checkpoint.coordinate.prepare.${kind}`).startTime),
    );
    expect(starts).toEqual([...starts].sort((a, b) => a - b));
    for (const kind of PREPARE_ORDER) {
      const stage = one(`gym.checkpoint.coordinate.prepare.${kind}`, { [ATTR_STAGE]: kind });
      const [participantSpan, ...others] = childrenOf(stage);
      expect(others).toEqual([]);
      expect(participantSpan!.name).toBe('gym.checkpoint.prepare');
      expect(participantSpan!.attributes).toMatchObject({
        [ATTR_CHECKPOINT_ID]: 'ck-1',
        [ATTR_KIND]: kind,
        [ATTR_INSTANCE]: `${kind}-1`,
        [ATTR_OUTCOME]: 'ok',
        [ATTR_PHASE]: 'prepared',
      });
      expect(names(childrenOf(participantSpan!))).toEqual([
        'gym.checkpoint.close_admission',
        'gym.checkpoint.wait_ready',
      ]);
    }
    expect(new Set(named('gym.checkpoint.prepare').map(traceId))).toEqual(
      new Set([traceId(controller)]),
    );
  });

  it('commit spans carry records and bytes, with export and write as children, in the controller’s trace', async () => {
    const { participants } = await stack();
    await prepare(participants, 'ck-2', deadline());
    const dir = join(root, 'ck-2');
    const replies = await commit(participants, 'ck-2', dir, [episodeId('ep-1', 0)], deadline());
    await waitForSpans('gym.checkpoint.commit', 4);

    const controller = one('gym.checkpoint.coordinate.commit', { [ATTR_CHECKPOINT_ID]: 'ck-2' });
    const commits = childrenOf(controller);
    expect(commits).toHaveLength(4);
    for (const span of commits) {
      expect(span.name).toBe('gym.checkpoint.commit');
      const instance = span.attributes[ATTR_INSTANCE] as string;
      const manifest = replies[instance]!.manifest as { records_bytes: number };
      expect(span.attributes).toMatchObject({
        [ATTR_RECORDS]: 1,
        [ATTR_BYTES]: manifest.records_bytes,
        [ATTR_PHASE]: 'committed',
      });
      expect(names(childrenOf(span))).toEqual([
        'gym.checkpoint.export',
        'gym.checkpoint.restored_cleanup',
        'gym.checkpoint.write',
      ]);
      // Within the operation's span, give or take the SDK's clock: it anchors each span to
      // Date.now(), a whole millisecond.
      for (const child of childrenOf(span)) {
        expect(hrMs(child.startTime)).toBeGreaterThanOrEqual(hrMs(span.startTime) - 1);
        expect(hrMs(child.endTime)).toBeLessThanOrEqual(hrMs(span.endTime) + 1);
      }
    }
  });

  it('restore spans carry the source, records and bytes, with read and install as children', async () => {
    const { participants } = await stack();
    await prepare(participants, 'ck-5', deadline());
    const dir = join(root, 'ck-5');
    await commit(participants, 'ck-5', dir, [episodeId('ep-1', 0)], deadline());
    await resume(participants, 'ck-5', deadline());
    await restore(participants, 'rs-5', dir, [episodeId('ep-1', 0)], deadline());
    await waitForSpans('gym.checkpoint.restore', 4);

    const restores = childrenOf(one('gym.checkpoint.coordinate.restore'));
    expect(names(restores)).toEqual(Array(4).fill('gym.checkpoint.restore'));
    for (const span of restores) {
      expect(span.attributes).toMatchObject({
        [ATTR_CHECKPOINT_ID]: 'rs-5',
        [ATTR_SOURCE_ID]: 'ck-5',
        [ATTR_RECORDS]: 1,
        [ATTR_PHASE]: 'restored',
      });
      expect(span.attributes[ATTR_BYTES]).toBeGreaterThan(0);
      expect(names(childrenOf(span))).toEqual([
        'gym.checkpoint.close_admission',
        'gym.checkpoint.install',
        'gym.checkpoint.read',
      ]);
    }
  });

  it('resume and retire have their participant spans under the controller’s stages', async () => {
    const { participants } = await stack();
    await prepare(participants, 'ck-3', deadline());
    await resume(participants, 'ck-3', deadline());
    await retire(participants, 'rt-1', [episodeId('ep-1', 0)], deadline());
    await waitForSpans('gym.checkpoint.resume', 4);
    await waitForSpans('gym.checkpoint.retire', 4);

    const resumeStages = childrenOf(one('gym.checkpoint.coordinate.resume'));
    expect(resumeStages).toHaveLength(4);
    for (const stage of resumeStages) {
      expect(names(childrenOf(stage))).toEqual(['gym.checkpoint.resume']);
    }
    const retireStages = childrenOf(one('gym.checkpoint.coordinate.retire'));
    expect(names(retireStages)).toEqual([
      'gym.checkpoint.coordinate.retire.agent',
      'gym.checkpoint.coordinate.retire.environment',
      'gym.checkpoint.coordinate.retire.model+resources',
    ]);
    for (const span of named('gym.checkpoint.retire')) {
      expect(span.attributes[ATTR_RECORDS]).toBe(1);
      expect(names(childrenOf(span))).toEqual(['gym.checkpoint.retire_drain']);
    }
  });

  it('a refused call marks its span failed with the refusal’s code', async () => {
    const { participants } = await stack();
    await prepare(participants, 'ck-4', deadline());
    // Retire is refused while a checkpoint is open.
    await expect(
      retire(participants, 'rt-2', [episodeId('ep-1', 0)], deadline()),
    ).rejects.toThrow();
    await waitForSpans('gym.checkpoint.retire', 1);
    const refused = named('gym.checkpoint.retire')[0]!;
    expect(refused.status.code).toBe(2); // SpanStatusCode.ERROR
    expect(refused.attributes[ATTR_OUTCOME]).toBe('invalid_phase');
    expect(one('gym.checkpoint.coordinate.retire').status.code).toBe(2);
  });
});

function hrMs([seconds, nanos]: readonly [number, number]): number {
  return seconds * 1000 + nanos / 1e6;
}
