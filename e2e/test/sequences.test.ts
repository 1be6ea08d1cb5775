/**
 * Random sequences over ten rollouts on the native stack, with the backend gated: starts, releases
 * of gated model calls, checkpoints (then resume or crash and restore), and retires. The odd
 * rollouts run on MCP tools (their own agent and environment over the same weather server): an
 * episode that grants MCP access is a restart, so it keeps running through a checkpoint, is not
 * exported, and starts over after a crash. At the end
 * every reward is 1.0, the model made at most two calls per attempt dispatched, every server is
 * idle with nothing tracked and no marks, and every committed checkpoint reads back.
 *
 * `CKPT_GYM_E2E_SEED=<n>` replays one seed; otherwise `CKPT_GYM_E2E_SEQUENCE_SEEDS` (default 2)
 * random seeds run. A failure names its seed.
 */
import { commit, forget, prepare, resume, retire } from '@ckpt-gym/core/client';
import { captureKey, type EpisodeId, parseCaptureKey } from '@ckpt-gym/core/protocol';
import { deadline, ep, tracked } from '@ckpt-gym/testing';

import { closeAll, Deployment, scenario } from './support/deployment.js';
import { type StackOptions, weatherEpisode } from './support/stacks.js';

afterEach(closeAll);

const ROLLOUTS = 10;
/** The environment of the rollouts on MCP tools. */
const MCP_ENV = 'mcp_env';
const STEPS = 30;

/** mulberry32: a small seeded PRNG, so a seed replays the same sequence of operations. */
function prng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

type Outcome = 'done' | 'refused' | 'stale' | 'cut' | 'failed';

interface Rollout {
  id: string;
  attempt: number;
  /** Bumped on every dispatch: a late reply of an older dispatch is ignored. */
  dispatch: number;
  state: 'pending' | 'running' | 'refused' | 'done';
  /** The environment it runs on: `env` (direct HTTP tools) or `mcp_env` (MCP tools). */
  env: string;
  reward?: unknown;
  /** Settles when the current dispatch's reply arrived (or its connection was cut). */
  settled?: Promise<void>;
}

class Sequence {
  readonly rollouts: Rollout[];
  readonly failures: string[] = [];
  /** A crash is killing the gym's processes one group after another. */
  #crashing = false;
  readonly committed: string[] = [];
  attemptsDispatched = 0;
  checkpoints = 0;
  readonly log: string[] = [];

  constructor(
    readonly dep: Deployment,
    readonly random: () => number,
  ) {
    this.rollouts = Array.from({ length: ROLLOUTS }, (_, i) => ({
      id: `seq-${i}`,
      attempt: 0,
      dispatch: 0,
      state: 'pending' as const,
      env: i % 2 === 1 ? MCP_ENV : 'env',
    }));
  }

  pick<T>(items: readonly T[]): T | undefined {
    return items.length === 0 ? undefined : items[Math.floor(this.random() * items.length)];
  }

  dispatch(r: Rollout): void {
    r.dispatch += 1;
    const mine = r.dispatch;
    r.state = 'running';
    this.attemptsDispatched += 1;
    const run = this.dep.post(r.env, '/run', weatherEpisode(r.id, r.attempt));
    r.settled = run.reply.then(
      (reply) => {
        if (r.dispatch !== mine) return;
        this.record(r, classify(reply.status, reply.body), reply.body);
      },
      () => {
        if (r.dispatch === mine) this.record(r, 'cut', {});
      },
    );
  }

  private record(r: Rollout, outcome: Outcome, body: Record<string, unknown>): void {
    if (outcome === 'done') {
      r.state = 'done';
      r.reward = (body.result as { reward?: unknown } | null)?.reward;
    } else if (outcome === 'refused') {
      r.state = 'refused';
    } else if (outcome === 'failed' && this.#cutByCrash(r, body)) {
      // Handled as a cut: the rollout starts over after the restore.
    } else if (outcome === 'failed') {
      this.failures.push(`${captureKey(ep(r.id, r.attempt))}: ${JSON.stringify(body)}`);
      r.state = 'done';
    }
    // 'stale' (retired) and 'cut' (crash) are handled by whoever retired or crashed.
  }

  /**
   * A restart (a rollout on MCP tools) runs through the checkpoint; when the crash kills the
   * resources server before its environment, the environment can still answer the cut call as a
   * non-terminal failure, which is the crash cutting it (it starts over), not a failed rollout.
   */
  #cutByCrash(r: Rollout, body: Record<string, unknown>): boolean {
    const failure = body.failure as { terminal?: unknown } | null | undefined;
    return this.#crashing && r.env === MCP_ENV && failure?.terminal === false;
  }

  running(): Rollout[] {
    return this.rollouts.filter((r) => r.state === 'running');
  }

  async step(): Promise<void> {
    const ops: [number, () => Promise<void>][] = [
      [3, () => this.start()],
      [6, () => this.release()],
      [2, () => this.checkpoint()],
      [
        2,
        async () => {
          await this.start();
          await this.start();
          await this.start();
          await this.checkpoint();
        },
      ],
      [1, () => this.retireOne()],
    ];
    const total = ops.reduce((sum, [w]) => sum + w, 0);
    let roll = this.random() * total;
    for (const [weight, op] of ops) {
      roll -= weight;
      if (roll < 0) return op();
    }
  }

  async start(): Promise<void> {
    const r = this.pick(
      this.rollouts.filter((x) => x.state === 'pending' || x.state === 'refused'),
    );
    if (!r) return;
    this.log.push(`start ${captureKey(ep(r.id, r.attempt))}`);
    this.dispatch(r);
  }

  async release(): Promise<void> {
    const calls = 1 + Math.floor(this.random() * 3);
    this.log.push(`release ${calls}`);
    await this.dep.backend('/_ctl/step', { calls });
  }

  async retireOne(): Promise<void> {
    const r = this.pick(this.running());
    if (!r) return;
    this.log.push(`retire ${captureKey(ep(r.id, r.attempt))}`);
    await retire(
      this.dep.participants(),
      `retire-${r.id}-${r.attempt}`,
      [ep(r.id, r.attempt)],
      deadline(30),
    );
    await r.settled;
    if (!finished(r)) {
      r.attempt += 1;
      r.state = 'pending';
    }
  }

  async checkpoint(): Promise<void> {
    const id = `c${++this.checkpoints}`;
    const participants = this.dep.participants();
    const prepared = await prepare(participants, id, deadline(5));
    if (!prepared.prepared) {
      // Stragglers: resume, retire them, and run them again as their next attempt.
      this.log.push(`checkpoint ${id}: not prepared ${JSON.stringify(prepared.blockers())}`);
      await resume(participants, id, deadline(30));
      const keys = new Set(Object.values(prepared.blockers()).flat());
      for (const key of keys) {
        const episode = parseCaptureKey(key);
        const r = this.rollouts.find(
          (x) => x.id === episode.rollout_id && x.attempt === episode.attempt,
        );
        if (!r || r.state !== 'running') continue;
        await retire(participants, `retire-${key}`, [episode], deadline(30));
        await r.settled;
        if (!finished(r)) {
          r.attempt += 1;
          this.dispatch(r);
        }
      }
      return;
    }
    const envs = [await this.dep.status('env'), await this.dep.status(MCP_ENV)];
    const scope = envs
      .flatMap((env) => [...(env.episodes as string[]), ...(env.restored_pending as string[])])
      .map(parseCaptureKey);
    // The restarts prepare reported (rollouts on MCP tools) are left out of the scope.
    const inScope = prepared.continued(scope);
    const replies = await commit(
      participants,
      id,
      this.dep.checkpointDir(id),
      inScope,
      deadline(10),
    );
    this.committed.push(id);
    const exported = new Set([
      ...((replies.env?.episode_ids ?? []) as string[]),
      ...((replies[MCP_ENV]?.episode_ids ?? []) as string[]),
    ]);
    // What was not exported has replied (finished before the checkpoint, or was refused), but
    // for a rollout on MCP tools: a restart, it keeps running through the checkpoint.
    await Promise.all(
      this.running()
        .filter((r) => !exported.has(captureKey(ep(r.id, r.attempt))) && r.env !== MCP_ENV)
        .map((r) => r.settled),
    );
    if (this.random() < 0.5) {
      this.log.push(`checkpoint ${id}: resume (${[...exported].join(',')})`);
      await resume(participants, id, deadline(30));
      for (const r of this.rollouts) if (r.state === 'refused') this.dispatch(r);
      return;
    }
    this.log.push(`checkpoint ${id}: crash and restore (${[...exported].join(',')})`);
    const restoredEpisodes: EpisodeId[] = [...exported].map(parseCaptureKey);
    const continued = this.running();
    this.#crashing = true;
    await this.dep.crashAndRestore(id, restoredEpisodes, {
      beforeRestart: async () => {
        await this.dep.backend('/_ctl/gate', { closed: true });
      },
    });
    await Promise.all(continued.map((r) => r.settled));
    this.#crashing = false;
    for (const r of this.rollouts) {
      if (exported.has(captureKey(ep(r.id, r.attempt)))) {
        r.attempt += 1;
        this.dispatch(r);
      } else if (r.state === 'refused' || r.state === 'running') {
        this.dispatch(r);
      }
    }
  }

  /** Opens the gate, runs every rollout to its end and forgets every rollout (all are done for good). */
  async finish(): Promise<void> {
    await this.dep.backend('/_ctl/release', {});
    for (;;) {
      for (const r of this.rollouts)
        if (r.state === 'pending' || r.state === 'refused') this.dispatch(r);
      await Promise.all(this.rollouts.map((r) => r.settled));
      if (this.rollouts.every((r) => r.state === 'done')) break;
    }
    await forget(
      this.dep.participants(),
      'forget-all',
      this.rollouts.map((r) => r.id),
      deadline(30),
    );
  }
}

/** Read through a function: the reply handler changes the state while a retire is awaited. */
function finished(r: Rollout): boolean {
  return r.state === 'done';
}

function classify(status: number, body: Record<string, unknown>): Outcome {
  const code = (body.error as { code?: string } | undefined)?.code;
  if (status === 200 && body.failure === null) return 'done';
  if (status === 409 && code === 'admission_closed') return 'refused';
  if (status === 409 && code === 'stale_attempt') return 'stale';
  return 'failed';
}

function seeds(): number[] {
  const fixed = process.env.CKPT_GYM_E2E_SEED;
  if (fixed !== undefined) return [Number(fixed)];
  const count = Number(process.env.CKPT_GYM_E2E_SEQUENCE_SEEDS ?? 2);
  return Array.from({ length: count }, () => Math.floor(Math.random() * 2 ** 31));
}

/**
 * Run with every server in one process, with two policy workers, and with two workers of every
 * server kind (policy model, resources, agents, environments): idle, all track nothing.
 */
const VARIANTS: readonly { label: string; options: StackOptions }[] = [
  { label: '', options: {} },
  { label: ', two policy workers', options: { policyWorkers: 2 } },
  {
    label: ', two workers of every kind',
    options: { policyWorkers: 2, resourcesWorkers: 2, agentWorkers: 2, envWorkers: 2 },
  },
];

for (const seed of seeds()) {
  for (const variant of VARIANTS) {
    scenario(
      `a random sequence keeps every rollout exactly once (seed ${seed}${variant.label}; replay with CKPT_GYM_E2E_SEED=${seed})`,
      async () => {
        const dep = await Deployment.start('native_mcp', variant.options);
        await dep.backend('/_ctl/gate', { closed: true });
        const sequence = new Sequence(dep, prng(seed));
        try {
          for (let i = 0; i < STEPS; i += 1) await sequence.step();
          await sequence.finish();

          expect(sequence.failures).toEqual([]);
          expect(sequence.rollouts.map((r) => r.reward)).toEqual(Array(ROLLOUTS).fill(1));
          expect(await dep.callCount()).toBeLessThanOrEqual(2 * sequence.attemptsDispatched);
          expect(tracked(await dep.statuses())).toEqual({});
          for (const id of sequence.committed) {
            for (const s of dep.gymServers()) await dep.records(id, s.kind, s.name);
          }
        } catch (err) {
          process.stderr.write(
            `\nseed ${seed} (replay with CKPT_GYM_E2E_SEED=${seed}):\n  ${sequence.log.join('\n  ')}\n`,
          );
          throw err;
        }
      },
      300_000,
    );
  }
}
