import {
  agentCloseAdmission,
  agentSeedAdmission,
  type Decision,
  episodeRunAdmission,
  legacyRunAdmission,
  modelCallAdmission,
  type ResourcesRequestState,
  resourcesAdmission,
  resourcesWaits,
  restartCallAdmission,
} from '../../src/admission/rules.js';

const r = (attempt = 0) => ({ rollout_id: 'r', attempt });
/** The decision's kind, or the refusal's code. */
const outcome = (d: Decision): string => (d.kind === 'refuse' ? d.error.code : d.kind);

describe('modelCallAdmission', () => {
  test('a call waits while closed, and a retired attempt is refused even then', () => {
    expect(outcome(modelCallAdmission({ open: true, key: 'r', retired: false }))).toBe('admit');
    expect(outcome(modelCallAdmission({ open: false, key: 'r', retired: false }))).toBe('wait');
    expect(outcome(modelCallAdmission({ open: false, key: 'r', retired: true }))).toBe(
      'stale_attempt',
    );
  });

  test('an untagged call is never refused', () => {
    expect(outcome(modelCallAdmission({ open: false, key: undefined, retired: true }))).toBe(
      'wait',
    );
  });
});

describe('resourcesWaits', () => {
  const waits = (
    role: 'start' | 'close' | 'verify' | 'tool',
    mode: 'restart_only' | 'stateless',
    verify: 'replay' | 'wait',
  ) => resourcesWaits({ open: false, role, mode, verify });

  test('while closed a start always waits; in restart_only nothing else does', () => {
    expect(waits('start', 'restart_only', 'wait')).toBe(true);
    expect(waits('tool', 'restart_only', 'wait')).toBe(false);
    expect(waits('close', 'restart_only', 'wait')).toBe(false);
  });

  test('otherwise everything waits but a replayable verify', () => {
    expect(waits('tool', 'stateless', 'wait')).toBe(true);
    expect(waits('verify', 'stateless', 'wait')).toBe(true);
    expect(waits('verify', 'stateless', 'replay')).toBe(false);
  });

  test('nothing waits while open', () => {
    expect(resourcesWaits({ open: true, role: 'start', mode: 'exported', verify: 'wait' })).toBe(
      false,
    );
  });
});

describe('resourcesAdmission', () => {
  const base: ResourcesRequestState = {
    open: true,
    role: 'tool',
    mode: 'exported',
    verify: 'wait',
    path: '/t',
    sessionId: 's',
    episode: r(1),
    attemptRetired: false,
    sessionRetired: false,
    session: { key: 'r-a1', episode: r(1), restored: false },
  };
  const of = (over: Partial<ResourcesRequestState>) =>
    outcome(resourcesAdmission({ ...base, ...over }));

  test('a start, close or verify needs its attempt, before any wait', () => {
    expect(of({ role: 'start', episode: undefined, open: false })).toBe('rollout_id_required');
    expect(of({ role: 'tool', episode: undefined })).toBe('admit');
  });

  test('the wait comes before the refusals', () => {
    expect(of({ open: false, attemptRetired: true })).toBe('wait');
    expect(of({ attemptRetired: true })).toBe('stale_attempt');
  });

  test('a close is never refused for a retire', () => {
    expect(of({ role: 'close', sessionRetired: true, attemptRetired: true })).toBe('admit');
    expect(of({ sessionRetired: true })).toBe('stale_attempt');
  });

  test("another attempt's session is refused; a restored one needs its attempt named", () => {
    expect(of({ episode: r(2) })).toBe('stale_attempt');
    expect(of({ role: 'start', episode: r(2) })).toBe('admit');
    const restored = { key: 'r-a1', episode: r(1), restored: true };
    expect(of({ episode: undefined, session: restored })).toBe('rollout_id_required');
    expect(of({ session: restored })).toBe('admit');
  });
});

describe('agent rules', () => {
  test('a seed is refused when retired, and waits while closed', () => {
    expect(outcome(agentSeedAdmission({ open: false, episode: r(), retired: true }))).toBe(
      'stale_attempt',
    );
    expect(outcome(agentSeedAdmission({ open: false, episode: r(), retired: false }))).toBe('wait');
    expect(outcome(agentSeedAdmission({ open: true, episode: r(), retired: false }))).toBe('admit');
  });

  test('a close waits while closed', () => {
    expect(outcome(agentCloseAdmission({ open: false }))).toBe('wait');
    expect(outcome(agentCloseAdmission({ open: true }))).toBe('admit');
  });

  test('a restart never waits; a retired one is refused', () => {
    expect(outcome(restartCallAdmission({ episode: r(), retired: false }))).toBe('admit');
    expect(outcome(restartCallAdmission({ episode: r(), retired: true }))).toBe('stale_attempt');
  });

  test('a new legacy run is refused while closed; a restored one of its attempt continues', () => {
    const state = { open: false, episode: r(1), retired: false, key: 'run:r', existing: undefined };
    expect(legacyRunAdmission(state)?.code).toBe('admission_closed');
    const existing = { episode: r(1), restoredPending: true, retired: false };
    expect(legacyRunAdmission({ ...state, existing })).toBeUndefined();
    expect(
      legacyRunAdmission({ ...state, existing: { ...existing, restoredPending: false } })?.code,
    ).toBe('checkpoint_error');
    expect(legacyRunAdmission({ ...state, existing: { ...existing, episode: r(0) } })?.code).toBe(
      'stale_attempt',
    );
  });
});

describe('episodeRunAdmission', () => {
  const state = {
    open: true,
    episode: r(1),
    retired: false,
    key: 'r-a1',
    restored: undefined,
    awaitingResume: false,
    running: false,
  };

  test('retired first, then closed admission, then the task, then a running attempt', () => {
    expect(episodeRunAdmission({ ...state, retired: true, open: false })?.code).toBe(
      'stale_attempt',
    );
    expect(episodeRunAdmission({ ...state, open: false })?.code).toBe('admission_closed');
    expect(
      episodeRunAdmission({ ...state, open: false, restored: { sameTask: false } })?.code,
    ).toBe('checkpoint_error');
    expect(episodeRunAdmission({ ...state, running: true })?.code).toBe('checkpoint_error');
    expect(episodeRunAdmission(state)).toBeUndefined();
  });

  test('a replacement is admitted while closed only after the post-restore resume', () => {
    const replacement = { ...state, open: false, restored: { sameTask: true } };
    expect(episodeRunAdmission(replacement)).toBeUndefined();
    expect(episodeRunAdmission({ ...replacement, awaitingResume: true })?.code).toBe(
      'admission_closed',
    );
  });
});
