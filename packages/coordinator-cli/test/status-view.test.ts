/** What `status --watch` shows of a server, from its status reply (pure). */
import {
  formatWorkers,
  type ServerStatus,
  watchedServer,
  watchFrame,
  watchJsonLine,
  watchLine,
  workersOf,
  workersTable,
} from '../src/status-view.js';

/** An operation that ended ok taking `ms`, with its stages (name and ms). */
function operation(
  ms: number,
  stages: [string, number][],
  counts: { episodes: number; bytes?: number } = { episodes: 0 },
) {
  return {
    outcome: 'ok',
    ended_at: 100,
    ms,
    cpu_ms: 1,
    ...counts,
    stages: stages.map(([name, stageMs]) => ({ name, ms: stageMs, cpu_ms: 1 })),
  };
}

const lastCheckpoint = {
  checkpoint_id: 'c1',
  operations: {
    prepare: operation(12, [
      ['close_admission', 1],
      ['readiness_wait', 11],
    ]),
    commit: operation(
      40,
      [
        ['export', 20],
        ['records_write', 18],
      ],
      { episodes: 3, bytes: 900 },
    ),
  },
};

/** A policy model's status with two workers, one lost. */
const policy: ServerStatus = {
  server: 'policy',
  kind: 'model',
  url: 'http://127.0.0.1:1',
  participant: true,
  status: {
    phase: 'prepared',
    checkpoint_id: 'c2',
    report: { counts: { inflight: 5, held: 2 } },
    waiting: 1,
    workers: [
      { index: 0, pid: 11, ready: true },
      { index: 1, pid: 12, ready: false },
    ],
    expected_workers: 2,
    lost_workers: 1,
    last_checkpoint: lastCheckpoint,
  },
};

const agent: ServerStatus = {
  server: 'agent',
  kind: 'agent',
  url: 'http://127.0.0.1:2',
  participant: true,
  status: {
    phase: 'idle',
    checkpoint_id: null,
    report: { counts: { sessions: 4, at_boundary: 1, waiting_for_resume: 3 } },
    last_checkpoint: null,
  },
};

const down: ServerStatus = {
  server: 'env',
  kind: 'environment',
  url: 'http://127.0.0.1:3',
  participant: false,
  error: 'connect ECONNREFUSED',
};

describe('watchedServer', () => {
  test('takes in flight, held and waiting from each kind’s counts and extras', () => {
    expect(watchedServer(policy)).toMatchObject({
      phase: 'prepared',
      checkpoint_id: 'c2',
      inflight: 5,
      held: 2,
      waiting: 1,
      last_checkpoint: lastCheckpoint,
    });
    expect(watchedServer(agent)).toMatchObject({ inflight: 4, held: null, waiting: 3 });
  });

  test('a failing server shows its error and nothing else', () => {
    expect(watchedServer(down)).toEqual({
      server: 'env',
      kind: 'environment',
      phase: 'error',
      checkpoint_id: null,
      inflight: null,
      held: null,
      waiting: null,
      workers: null,
      last_checkpoint: null,
      error: 'connect ECONNREFUSED',
    });
  });
});

describe('workers', () => {
  test('a status without workers is a server of one process', () => {
    expect(workersOf(agent.status!)).toBeNull();
    expect(formatWorkers({ phase: 'idle', workers: null })).toBe('-');
  });

  test('up out of expected, ready only while a checkpoint is open, and the lost ones', () => {
    const view = workersOf(policy.status!);
    expect(view).toEqual({
      workers: [
        { index: 0, pid: 11, ready: true },
        { index: 1, pid: 12, ready: false },
      ],
      expected: 2,
      lost: 1,
    });
    expect(formatWorkers({ phase: 'prepared', workers: view })).toBe('2/2 up, 1 ready, 1 lost');
    expect(formatWorkers({ phase: 'prepared', workers: { ...view!, lost: 0 } })).toBe(
      '2/2 up, 1 ready',
    );
    expect(formatWorkers({ phase: 'idle', workers: { ...view!, lost: 0 } })).toBe('2/2 up');
    const left = workersOf({
      workers: [{ index: 1, pid: 11, ready: false }],
      expected_workers: 2,
      lost_workers: 1,
    });
    expect(formatWorkers({ phase: 'idle', workers: left })).toBe('1/2 up, 1 lost');
  });

  test('the workers table: READY is - while no checkpoint is open', () => {
    const idle = watchedServer({ ...policy, status: { ...policy.status, phase: 'idle' } });
    expect(workersTable([idle]).split('\n')).toEqual([
      'SERVER  WORKER  PID  READY',
      'policy  0       11   -',
      'policy  1       12   -',
    ]);
    expect(workersTable([watchedServer(agent)])).toBe('');
  });
});

describe('renderings', () => {
  const at = new Date('2026-12-01T17:00:00.000Z');
  const servers = [policy, agent, down].map(watchedServer);

  test('one text line a refresh, every server with its fields and last checkpoint', () => {
    const line = watchLine(at, servers);
    expect(line).not.toContain('\n');
    expect(line).toBe(
      '2026-12-01T17:00:00.000Z ' +
        'policy phase=prepared checkpoint=c2 inflight=5 held=2 waiting=1 ' +
        'workers=2/2_up,_1_ready,_1_lost last=c1 ' +
        '[prepare ok 12 ms (close_admission 1, readiness_wait 11)] ' +
        '[commit ok 40 ms (export 20, records_write 18)] | ' +
        'agent phase=idle inflight=4 held=- waiting=3 | ' +
        'env phase=error inflight=- held=- waiting=- error="connect ECONNREFUSED"',
    );
  });

  test('one JSON object a refresh', () => {
    const line = watchJsonLine(at, servers);
    expect(line).not.toContain('\n');
    expect(JSON.parse(line)).toEqual({ at: at.toISOString(), servers });
  });

  test('the terminal frame: the servers, the last checkpoint’s stages, the workers', () => {
    const frame = watchFrame('title', servers).split('\n');
    expect(frame).toEqual([
      'title',
      '',
      'SERVER  KIND         PHASE     CHECKPOINT  INFLIGHT  HELD  WAITING  WORKERS',
      'policy  model        prepared  c2          5         2     1        2/2 up, 1 ready, 1 lost',
      'agent   agent        idle      -           4         -     3        -',
      'env     environment  error     -           -         -     -        -',
      '',
      'last checkpoint:',
      'SERVER  CHECKPOINT  OPERATION',
      'policy  c1          prepare ok 12 ms (close_admission 1, readiness_wait 11)',
      'policy  c1          commit ok 40 ms (export 20, records_write 18)',
      '',
      'workers:',
      'SERVER  WORKER  PID  READY',
      'policy  0       11   yes',
      'policy  1       12   no',
      'env: connect ECONNREFUSED',
    ]);
  });
});
