/**
 * Model-based test of the control plane: random sequences of prepare, commit (fresh or retried),
 * resume, restore, retire, forget, data-plane progress, a slow or failing export, and time passing
 * (a controller that stops calling, so the lease expires), checking after every step:
 *
 * - phase and admission agree, and a checkpoint id is set exactly outside idle;
 * - no manifest appears in a checkpoint's directories after its resume returned (or it expired);
 * - a resumed checkpoint id is refused (`stale_checkpoint`), within the last 64;
 * - retired marks never go down, except through forget;
 * - a commit exports only episodes in its scope, a retried commit returns the same manifest, and a
 *   failed export stays final for its checkpoint.
 *
 * Time is a fake clock advanced only while no storage I/O is in flight, so a run depends on its
 * seed alone. Replay a failure with CONTROL_MODEL_SEED=<seed> (and CONTROL_MODEL_PATH=<path>).
 */
import { existsSync } from 'node:fs';
import { join } from 'node:path';

import fc from 'fast-check';

import { RESUMED_IDS_KEPT } from '../../src/control/plane.js';
import { CkptGymError } from '../../src/errors.js';
import { captureKey, nextAttempt, parseCaptureKey } from '../../src/identity.js';
import { MANIFEST_FILE, readParticipantState, writeParticipantState } from '../../src/store.js';
import { Gate } from '../support/test-participant.js';
import { type Harness, harness, settle, useHarness } from './harness.js';

useHarness();

const DEADLINE_SECONDS = 3;
const LEASE_GRACE_SECONDS = 5;

interface Real {
  h: Harness;
  /** Storage calls in flight: the clock does not move while the disk works. */
  io: { inFlight: number };
  /** When set, writes wait for it before touching the disk (a slow disk the clock runs past). */
  writes: { gate: Gate | null };
}

interface Model {
  nextId: number;
  nextRollout: number;
  /** The open checkpoint as last observed. */
  active: string | null;
  /** Resumed ids, oldest first, as the plane's memory keeps them. */
  resumed: string[];
  /** Directories each checkpoint committed into. */
  dirsOf: Map<string, Set<string>>;
  /** Directories of ended checkpoints that had no manifest when they ended. */
  emptyWhenEnded: Set<string>;
  /** The last commit request per checkpoint, for retries. */
  lastCommit: Map<string, { dir: string; scope: string[] }>;
  /** Successful commit manifests by checkpoint id and directory. */
  manifests: Map<string, unknown>;
  /** Checkpoints whose export failed (final until they end). */
  exportFailed: Set<string>;
  /** Restarts each checkpoint's prepares carried. */
  carried: Map<string, Set<string>>;
  /** Committed checkpoints a restore may read: directory and exported keys. */
  sources: { dir: string; keys: string[] }[];
  marks: Map<string, number>;
}

type IdPick = 'active' | 'fresh' | 'stale';

function remember(m: Model, id: string): void {
  if (m.resumed.includes(id)) return;
  m.resumed.push(id);
  if (m.resumed.length > RESUMED_IDS_KEPT) m.resumed.shift();
}

function pickId(m: Model, pick: IdPick, index: number): string {
  if (pick === 'active' && m.active !== null) return m.active;
  if (pick === 'stale' && m.resumed.length > 0)
    return m.resumed[index % m.resumed.length] as string;
  m.nextId += 1;
  return `c${m.nextId}`;
}

function manifestOf(r: Real, dir: string): string {
  return join(dir, 'gym', r.h.participant.kind, r.h.participant.instance, MANIFEST_FILE);
}

/** Every capture key the participant holds: live episodes and unclaimed restored state. */
function heldKeys(r: Real): string[] {
  return [...r.h.participant.episodes.keys(), ...r.h.participant.restored.keys()].sort();
}

function choose<T>(items: readonly T[], picks: readonly number[]): T[] {
  if (items.length === 0) return [];
  return [...new Set(picks.map((p) => items[p % items.length] as T))];
}

type Outcome<T> = { ok: true; value: T } | { ok: false; error: CkptGymError };

/** Runs a control call to its end, moving the clock only while no storage I/O is in flight. */
async function drive<T>(r: Real, call: Promise<T>): Promise<Outcome<T>> {
  let outcome: Outcome<T> | undefined;
  call.then(
    (value) => (outcome = { ok: true, value }),
    (error: unknown) => {
      if (!(error instanceof CkptGymError)) throw error;
      outcome = { ok: false, error };
    },
  );
  const started = Date.now();
  while (outcome === undefined) {
    await settle(3);
    if (outcome !== undefined) break;
    if (Date.now() - started > 10_000) throw new Error('a control call never ended');
    if (r.io.inFlight > 0) await new Promise((resolve) => setTimeout(resolve, 1));
    else r.h.clock.advance(0.5);
  }
  return outcome;
}

function code<T>(outcome: Outcome<T>): string {
  return outcome.ok ? 'ok' : outcome.error.code;
}

/** Records what ended with checkpoint `id`: fenced from now on, and its empty directories stay empty. */
function ended(m: Model, r: Real, id: string): void {
  remember(m, id);
  for (const dir of m.dirsOf.get(id) ?? [])
    if (!existsSync(manifestOf(r, dir))) m.emptyWhenEnded.add(dir);
  m.exportFailed.delete(id);
}

/** Lets running storage I/O finish, so a write that should never publish has had its chance. */
async function quiesce(r: Real): Promise<void> {
  await settle(2);
  while (r.io.inFlight > 0) await new Promise((resolve) => setTimeout(resolve, 1));
  await settle(2);
}

async function observe(m: Model, r: Real, forgotten: readonly string[] = []): Promise<void> {
  await quiesce(r);
  const status = r.h.plane.status();
  expect(status.checkpoint_id === null).toBe(status.phase === 'idle');
  expect(r.h.participant.admissionOpen).toBe(status.phase === 'idle');
  if (m.active !== null && status.checkpoint_id !== m.active) ended(m, r, m.active);
  m.active = status.checkpoint_id;

  for (const dir of m.emptyWhenEnded)
    expect([dir, existsSync(manifestOf(r, dir))]).toEqual([dir, false]);

  const marks = new Map<string, number>();
  for (const rollout of r.h.participant.marks.rollouts()) {
    marks.set(rollout, r.h.participant.marks.highestRetired(rollout) as number);
  }
  for (const [rollout, attempt] of m.marks) {
    if (!forgotten.includes(rollout))
      expect([rollout, (marks.get(rollout) ?? -1) >= attempt]).toEqual([rollout, true]);
  }
  m.marks = marks;

  const latest = m.resumed.at(-1);
  if (latest !== undefined && latest !== m.active) {
    const renew = await drive(
      r,
      r.h.plane.renew({ checkpoint_id: latest, deadline_ts: r.h.at(1) }),
    );
    expect(code(renew)).toBe('stale_checkpoint');
  }
}

type Cmd = fc.AsyncCommand<Model, Real>;

class Progress implements Cmd {
  constructor(
    readonly starts: EpisodeStart[],
    readonly flips: number[],
    readonly regress: boolean,
  ) {}
  check = () => true;
  async run(m: Model, r: Real): Promise<void> {
    const p = r.h.participant;
    if (p.admissionOpen) {
      for (const state of this.starts) p.start(`e${m.nextRollout++}`, state);
      for (const key of choose([...p.episodes.keys()], this.flips)) {
        const live = p.episodes.get(key);
        if (live && live.state !== 'restart')
          p.setState(key, live.state === 'running' ? 'parked' : 'running');
      }
    } else {
      // Closed: running work reaches its boundary, except the chosen slow episodes; readiness
      // regresses only rarely.
      const slow = new Set(choose([...p.episodes.keys()], this.flips));
      for (const [key, live] of p.episodes) {
        if (live.state === 'running' && !slow.has(key)) p.setState(key, 'parked');
        else if (live.state === 'parked' && slow.has(key) && this.regress)
          p.setState(key, 'running');
      }
    }
    await observe(m, r);
  }
  toString = () =>
    `progress(${this.starts.join('+')}; flips=${this.flips.join(',')}${this.regress ? '; regress' : ''})`;
}

type EpisodeStart = 'running' | 'parked' | 'restart';

class Prepare implements Cmd {
  constructor(
    readonly pick: IdPick,
    readonly index: number,
    readonly restarts: number[],
  ) {}
  check = () => true;
  async run(m: Model, r: Real): Promise<void> {
    const id = pickId(m, this.pick, this.index);
    const stale = m.resumed.includes(id);
    const restarts = choose(heldKeys(r), this.restarts);
    if (!m.carried.has(id)) m.carried.set(id, new Set());
    for (const key of restarts) m.carried.get(id)?.add(key);
    const outcome = await drive(
      r,
      r.h.plane.prepare({ checkpoint_id: id, deadline_ts: r.h.at(DEADLINE_SECONDS), restarts }),
    );
    if (stale) expect(code(outcome)).toBe('stale_checkpoint');
    await observe(m, r);
  }
  toString = () => `prepare(${this.pick}#${this.index}; restarts=${this.restarts.join(',')})`;
}

/** What a controller continues: every episode held here, minus restarts (its own and carried). */
function continued(m: Model, r: Real, id: string): string[] {
  const carried = m.carried.get(id) ?? new Set();
  return heldKeys(r).filter(
    (key) => r.h.participant.episodes.get(key)?.state !== 'restart' && !carried.has(key),
  );
}

class Commit implements Cmd {
  constructor(
    readonly pick: IdPick,
    readonly index: number,
    /** Null: the continued episodes, as `PrepareResult.continued` builds the scope. */
    readonly scope: number[] | null,
    readonly retry: boolean,
    readonly stop: boolean,
  ) {}
  check = () => true;
  async run(m: Model, r: Real): Promise<void> {
    const id = pickId(m, this.pick, this.index);
    const stale = m.resumed.includes(id);
    const previous = m.lastCommit.get(id);
    const request =
      this.retry && previous
        ? // The same scope in another order must replay.
          { dir: previous.dir, scope: [...previous.scope].reverse() }
        : {
            dir: r.h.dir(`${id}-${m.nextId++}`),
            scope: this.scope === null ? continued(m, r, id) : choose(heldKeys(r), this.scope),
          };
    m.lastCommit.set(id, request);
    if (!m.dirsOf.has(id)) m.dirsOf.set(id, new Set());
    m.dirsOf.get(id)?.add(request.dir);
    const outcome = await drive(
      r,
      r.h.plane.commit({
        checkpoint_id: id,
        deadline_ts: r.h.at(DEADLINE_SECONDS),
        checkpoint_dir: request.dir,
        episode_ids: request.scope.map(parseCaptureKey),
        stop: this.stop,
      }),
    );
    if (stale) expect(code(outcome)).toBe('stale_checkpoint');
    // Final: every later commit of this checkpoint, whatever its arguments.
    if (m.exportFailed.has(id)) expect(code(outcome)).toBe('export_failed');
    if (!outcome.ok && outcome.error.code === 'export_failed') m.exportFailed.add(id);
    const key = `${id} ${request.dir}`;
    // A completed commit retried with the same scope (in another order) replays.
    if (this.retry && m.manifests.has(key) && m.active === id) expect(code(outcome)).toBe('ok');
    if (outcome.ok) {
      const scope = new Set(request.scope);
      expect(outcome.value.episode_ids.filter((key) => !scope.has(key))).toEqual([]);
      expect(existsSync(manifestOf(r, request.dir))).toBe(true);
      if (m.manifests.has(key)) expect(outcome.value.manifest).toEqual(m.manifests.get(key));
      m.manifests.set(key, outcome.value.manifest);
      m.sources.push({ dir: request.dir, keys: outcome.value.episode_ids });
    }
    await observe(m, r);
  }
  toString = () =>
    `commit(${this.pick}#${this.index}; scope=${this.scope?.join(',') ?? 'continued'}${this.retry ? '; retry' : ''}${this.stop ? '; stop' : ''})`;
}

class Resume implements Cmd {
  constructor(
    readonly pick: IdPick,
    readonly index: number,
  ) {}
  check = () => true;
  async run(m: Model, r: Real): Promise<void> {
    const id = pickId(m, this.pick, this.index);
    const wasActive = m.active === id;
    // Measured the moment resume returns: nothing may be published after that.
    const call = r.h.plane
      .resume({ checkpoint_id: id, deadline_ts: r.h.at(DEADLINE_SECONDS) })
      .then((reply) => {
        if (wasActive) ended(m, r, id);
        return reply;
      });
    const outcome = await drive(r, call);
    if (outcome.ok) {
      remember(m, id);
      if (wasActive) m.active = null;
    }
    await observe(m, r);
  }
  toString = () => `resume(${this.pick}#${this.index})`;
}

class Restore implements Cmd {
  constructor(
    readonly pick: IdPick,
    readonly index: number,
    readonly source: number,
    readonly scope: number[],
  ) {}
  check = (m: Readonly<Model>) => m.sources.length > 0;
  async run(m: Model, r: Real): Promise<void> {
    const id = pickId(m, this.pick, this.index);
    const stale = m.resumed.includes(id);
    const source = m.sources[this.source % m.sources.length] as Model['sources'][number];
    const scope = choose([...source.keys, 'never-saved'], this.scope);
    const outcome = await drive(
      r,
      r.h.plane.restore({
        checkpoint_id: id,
        deadline_ts: r.h.at(DEADLINE_SECONDS),
        checkpoint_dir: source.dir,
        episode_ids: scope.map(parseCaptureKey),
      }),
    );
    if (stale) expect(code(outcome)).toBe('stale_checkpoint');
    if (outcome.ok) {
      const saved = new Set(source.keys);
      const expected = scope
        .filter((key) => saved.has(key))
        .map((key) => captureKey(nextAttempt(parseCaptureKey(key))));
      expect(outcome.value.restored).toEqual(expected.sort());
    }
    await observe(m, r);
  }
  toString = () =>
    `restore(${this.pick}#${this.index}; source=${this.source}; scope=${this.scope.join(',')})`;
}

class Retire implements Cmd {
  constructor(readonly picks: number[]) {}
  check = () => true;
  async run(m: Model, r: Real): Promise<void> {
    const keys = choose([...heldKeys(r), 'gone-a3'], this.picks);
    if (keys.length === 0) return;
    const phase = r.h.plane.status().phase;
    const outcome = await drive(
      r,
      r.h.plane.retire({
        checkpoint_id: m.active ?? 'any',
        deadline_ts: r.h.at(DEADLINE_SECONDS),
        episode_ids: keys.map(parseCaptureKey),
      }),
    );
    if (phase === 'idle' || phase === 'restored') {
      expect(outcome.ok).toBe(true);
      for (const key of keys)
        expect([key, r.h.participant.marks.isRetired(parseCaptureKey(key))]).toEqual([key, true]);
    } else {
      expect(code(outcome)).toBe('invalid_phase');
    }
    await observe(m, r);
  }
  toString = () => `retire(${this.picks.join(',')})`;
}

class Forget implements Cmd {
  constructor(readonly picks: number[]) {}
  check = () => true;
  async run(m: Model, r: Real): Promise<void> {
    const rollouts = choose([...r.h.participant.marks.rollouts()].sort(), this.picks);
    if (rollouts.length === 0) return;
    const outcome = await drive(
      r,
      r.h.plane.forget({
        checkpoint_id: m.active ?? 'any',
        deadline_ts: r.h.at(DEADLINE_SECONDS),
        rollout_ids: rollouts,
      }),
    );
    if (outcome.ok) {
      expect(outcome.value.forgotten_count).toBe(rollouts.length);
      for (const rollout of rollouts)
        expect(r.h.participant.marks.highestRetired(rollout)).toBeUndefined();
    }
    await observe(m, r, outcome.ok ? rollouts : []);
  }
  toString = () => `forget(${this.picks.join(',')})`;
}

/** The controller's happy path: episodes reach their boundaries, prepare, commit what continues. */
class Checkpoint implements Cmd {
  constructor(readonly resume: boolean) {}
  check = () => true;
  async run(m: Model, r: Real): Promise<void> {
    await new Progress([], [], false).run(m, r);
    await new Prepare('fresh', 0, []).run(m, r);
    await new Progress([], [], false).run(m, r);
    await new Commit('active', 0, null, false, false).run(m, r);
    if (this.resume) await new Resume('active', 0).run(m, r);
  }
  toString = () => `checkpoint(${this.resume ? 'resume' : 'stay'})`;
}

/** Time passes without a control call; past the lease, the controller has stopped calling. */
class Wait implements Cmd {
  constructor(readonly seconds: number) {}
  check = () => true;
  async run(m: Model, r: Real): Promise<void> {
    for (let waited = 0; waited < this.seconds;) {
      await settle(3);
      if (r.io.inFlight > 0) {
        await new Promise((resolve) => setTimeout(resolve, 1));
        continue;
      }
      r.h.clock.advance(0.5);
      waited += 0.5;
    }
    await observe(m, r);
  }
  toString = () => `wait(${this.seconds}s)`;
}

/** The next exports hang until released, or fail; the next writes stall until released. */
class ExportBehaviour implements Cmd {
  constructor(
    readonly behaviour: 'slow' | 'release' | 'fail' | 'heal' | 'slow-write' | 'release-write',
  ) {}
  check = () => true;
  async run(m: Model, r: Real): Promise<void> {
    const p = r.h.participant;
    if (this.behaviour === 'slow-write') r.writes.gate ??= new Gate();
    if (this.behaviour === 'release-write') {
      r.writes.gate?.open();
      r.writes.gate = null;
    }
    if (this.behaviour === 'slow') p.exportGate ??= new Gate();
    if (this.behaviour === 'release') {
      p.exportGate?.open();
      p.exportGate = null;
    }
    if (this.behaviour === 'fail') p.exportError = new Error('export failed');
    if (this.behaviour === 'heal') p.exportError = null;
    await observe(m, r);
  }
  toString = () => `export(${this.behaviour})`;
}

const idPick = fc.constantFrom<IdPick>('active', 'active', 'fresh', 'stale');
const picks = fc.array(fc.nat(50), { minLength: 1, maxLength: 4 });

const progress = fc
  .tuple(
    fc.array(fc.constantFrom<EpisodeStart>('running', 'parked', 'parked', 'parked', 'restart'), {
      maxLength: 3,
    }),
    fc.array(fc.nat(50), { maxLength: 4 }),
    // Readiness regressing while closed is rare.
    fc.nat(9).map((n) => n === 0),
  )
  .map(([starts, flips, regress]) => new Progress(starts, flips, regress));
const prepare = fc
  .tuple(idPick, fc.nat(100), fc.array(fc.nat(50), { maxLength: 2 }))
  .map(([p, i, rs]) => new Prepare(p, i, rs));
const commit = fc
  .tuple(
    fc.constantFrom<IdPick>('active', 'active', 'active', 'active', 'fresh', 'stale'),
    fc.nat(100),
    fc.option(picks, { nil: null }),
    fc.boolean(),
    fc.boolean(),
  )
  .map(([p, i, s, retry, stop]) => new Commit(p, i, s, retry, stop));
const resume = fc.tuple(idPick, fc.nat(100)).map(([p, i]) => new Resume(p, i));
const restore = fc
  .tuple(
    fc.constantFrom<IdPick>('fresh', 'fresh', 'fresh', 'active', 'stale'),
    fc.nat(100),
    fc.nat(50),
    picks,
  )
  .map(([p, i, s, sc]) => new Restore(p, i, s, sc));

/** Listed more than once to be drawn more often: checkpoints must get as far as a commit. */
const commands = [
  progress,
  progress,
  prepare,
  prepare,
  commit,
  commit,
  commit,
  resume,
  restore,
  restore,
  fc.boolean().map((resumeAfter) => new Checkpoint(resumeAfter)),
  picks.map((p) => new Retire(p)),
  picks.map((p) => new Forget(p)),
  fc.constantFrom(1, 4, 10).map((s) => new Wait(s)),
  fc
    .constantFrom<ExportBehaviour['behaviour']>(
      'slow',
      'release',
      'fail',
      'heal',
      'slow-write',
      'release-write',
    )
    .map((b) => new ExportBehaviour(b)),
];

function envNumber(name: string): number | undefined {
  const value = process.env[name];
  return value === undefined || value === '' ? undefined : Number(value);
}

test('the control plane keeps its invariants under random sequences of operations', async () => {
  const seed = envNumber('CONTROL_MODEL_SEED') ?? Date.now() ^ (Math.random() * 0x7fffffff);
  const path = process.env.CONTROL_MODEL_PATH;
  try {
    await fc.assert(
      fc.asyncProperty(fc.commands(commands, { maxCommands: 50, size: 'large' }), async (cmds) => {
        const io = { inFlight: 0 };
        const writes: Real['writes'] = { gate: null };
        const counted =
          <A extends unknown[], T>(fn: (...args: A) => Promise<T>) =>
          async (...args: A): Promise<T> => {
            io.inFlight += 1;
            try {
              return await fn(...args);
            } finally {
              io.inFlight -= 1;
            }
          };
        const h = harness({
          leaseGraceSeconds: LEASE_GRACE_SECONDS,
          storage: {
            write: async (opts) => {
              await writes.gate?.promise;
              return counted(writeParticipantState)(opts);
            },
            read: counted(readParticipantState),
          },
        });
        const model: Model = {
          nextId: 0,
          nextRollout: 0,
          active: null,
          resumed: [],
          dirsOf: new Map(),
          emptyWhenEnded: new Set(),
          lastCommit: new Map(),
          manifests: new Map(),
          exportFailed: new Set(),
          carried: new Map(),
          sources: [],
          marks: new Map(),
        };
        const real: Real = { h, io, writes };
        try {
          await fc.asyncModelRun(() => ({ model, real }), cmds);
        } finally {
          // Release what still hangs and let kept work finish before the next run starts.
          h.participant.exportGate?.open();
          writes.gate?.open();
          await quiesce(real);
          h.plane.dispose();
        }
        // Work released only now must not publish into an ended checkpoint either.
        for (const dir of model.emptyWhenEnded)
          expect([dir, existsSync(manifestOf(real, dir))]).toEqual([dir, false]);
      }),
      { numRuns: 60, seed, ...(path ? { path } : {}), endOnFailure: true },
    );
  } catch (err) {
    throw new Error(
      `control model failed; replay with CONTROL_MODEL_SEED=${seed}\n${String(err)}`,
      { cause: err },
    );
  }
});
