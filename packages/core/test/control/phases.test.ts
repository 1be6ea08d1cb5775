import {
  admissionError,
  ALLOWED_PHASES,
  extendedLease,
  type FencedOperation,
  outsideCheckpointError,
  type Phase,
  PHASES,
  resumeAction,
} from '../../src/control/phases.js';

const never = () => false;

function state(phase: Phase, checkpointId: string | null = phase === 'idle' ? null : 'c1') {
  return { phase, checkpointId };
}

describe('admission order', () => {
  test('a resumed id is stale before anything else', () => {
    const err = admissionError('prepare', state('prepared', 'other'), 'c1', (id) => id === 'c1');
    expect(err?.code).toBe('stale_checkpoint');
  });

  test('another active id conflicts before the phase is checked', () => {
    const err = admissionError('commit', state('preparing', 'other'), 'c1', never);
    expect(err?.code).toBe('checkpoint_conflict');
  });

  test('an operation outside its phases is invalid_phase', () => {
    expect(admissionError('commit', state('preparing'), 'c1', never)?.code).toBe('invalid_phase');
    expect(admissionError('restore', state('restored'), 'c1', never)?.code).toBe('invalid_phase');
    expect(admissionError('renew', state('idle'), 'c1', never)?.code).toBe('invalid_phase');
  });

  test('the operation × phase table', () => {
    const table: Record<FencedOperation, Phase[]> = {
      prepare: ['idle', 'preparing'],
      commit: ['prepared'],
      restore: ['idle'],
      renew: ['preparing', 'prepared', 'committed', 'restored'],
      resume: ['preparing', 'prepared', 'committed', 'restored'],
    };
    for (const [op, allowed] of Object.entries(table) as [FencedOperation, Phase[]][]) {
      expect([...ALLOWED_PHASES[op]].sort()).toEqual([...allowed].sort());
      for (const phase of PHASES) {
        const err = admissionError(op, state(phase), 'c1', never);
        expect([op, phase, err === undefined]).toEqual([op, phase, allowed.includes(phase)]);
      }
    }
  });
});

describe('retire and forget outside a checkpoint', () => {
  test('are refused while a checkpoint is open, telling the caller to resume first', () => {
    for (const phase of ['preparing', 'prepared', 'committed'] as const) {
      const err = outsideCheckpointError('retire', state(phase), 'c1');
      expect(err?.code).toBe('invalid_phase');
      expect(err?.message).toContain('resume first');
    }
  });

  test('an idle participant accepts any id', () => {
    expect(outsideCheckpointError('forget', state('idle'), 'anything')).toBeUndefined();
  });

  test('while restored, another id conflicts and the restored id is accepted', () => {
    expect(outsideCheckpointError('retire', state('restored', 'c9'), 'c1')?.code).toBe(
      'checkpoint_conflict',
    );
    expect(outsideCheckpointError('retire', state('restored', 'c9'), 'c9')).toBeUndefined();
  });
});

describe('resume', () => {
  test('a pending reopen is finished even for a resumed id', () => {
    expect(resumeAction(state('idle'), 'c1', () => true, true)).toBe('finish-reopen');
  });

  test('a resumed id and an idle participant are idempotent', () => {
    expect(resumeAction(state('prepared'), 'c1', () => true, false)).toBe('idempotent');
    expect(resumeAction(state('idle'), 'c1', never, false)).toBe('idempotent');
  });

  test('an open checkpoint is reopened, another id conflicts', () => {
    expect(resumeAction(state('committed'), 'c1', never, false)).toBe('reopen');
    expect(resumeAction(state('committed'), 'c2', never, false)).toMatchObject({
      code: 'checkpoint_conflict',
    });
  });
});

test('the lease never moves earlier', () => {
  expect(extendedLease(null, 100, 600)).toBe(700);
  expect(extendedLease(700, 50, 600)).toBe(700);
  expect(extendedLease(700, 200, 600)).toBe(800);
});
