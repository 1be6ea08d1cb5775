/**
 * The demo: the project's main job on an embedded default stack. Rollouts go in flight, a
 * checkpoint is taken, every gym process is SIGKILLed, fresh ones restore it, and the rollouts
 * finish, each exactly once, without a delivered model call being made again.
 *
 * Half the rollouts are weather tasks, half counter tasks (whose resources session state is
 * exported at the checkpoint and restored). The fake backend holds every rollout at its second
 * model call, so at the checkpoint each rollout is mid-flight at the same boundary; a quarter is let through first, to have rollouts
 * that finished before the checkpoint. The backend survives the crash and keeps its call log,
 * which is how "no delivered model call repeated" is checked.
 */
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';

import {
  type EpisodeId,
  forget,
  nextAttempt,
  parseCaptureKey,
  resume,
  retire,
} from '@ckpt-gym/core';

import { parseCommandLine } from './args.js';
import {
  Collector,
  counterTask,
  type Dispatch,
  type ResultRow,
  type TaskSpec,
  weatherTask,
} from './collect.js';
import { checkpointCommand } from './commands/checkpoint.js';
import { restoreCommand } from './commands/restore.js';
import { CliFailure, type CliIo, CommandContext, describe, generatedId } from './context.js';
import { freePort, launchStack, type StackHandle } from './launcher.js';
import { CONTROLLER_FILE, type ControllerRecord } from './publication.js';
import { readFile } from 'node:fs/promises';

/** Model calls a rollout needs: weather calls one tool then answers; counter calls two. */
export const MODEL_CALLS = { weather: 2, counter: 3 } as const;
type Taskset = keyof typeof MODEL_CALLS;
const WAIT_MS = 60_000;

export interface DemoReport {
  readonly rollouts: number;
  /** Rollouts by taskset. */
  readonly tasksets: Record<string, number>;
  readonly checkpoint_id: string;
  readonly finished_before_checkpoint: number;
  readonly continued: number;
  readonly restarted: number;
  /** Every model call the backend saw, dropped ones (held when the gym was killed) included. */
  readonly model_calls: number;
  readonly delivered_model_calls: number;
  readonly minimum_model_calls: number;
  /** Delivered calls made again for the same rollout at the same conversation length. */
  readonly repeated_model_calls: number;
  /** Rollouts with no result, or more than one. */
  readonly not_exactly_once: string[];
  /** Reward → number of rollouts. */
  readonly rewards: Record<string, number>;
  readonly seconds: Record<string, number>;
  readonly ok: boolean;
}

/** The embedded stack: every port free at run time; the backend's is fixed first (its URL is config). */
export function demoStackText(backendPort: number, token: string): string {
  return [
    '# The demo stack (written by ckpt-gym demo).',
    `checkpoint: { enabled: true, control_auth_token: ${token}, lease_grace_seconds: 600 }`,
    'token_capture: { enabled: true, dir: ./capture }',
    'servers:',
    `  inference:    { kind: inference,   app: fake, port: ${backendPort} }`,
    '  policy:       { kind: model,       app: policy, port: 0,',
    `                  backend_url: "http://127.0.0.1:${backendPort}/v1",`,
    '                  checkpoint_policy: true, checkpoint_generation_cuts: true }',
    '  weather:      { kind: resources,   app: weather, port: 0 }',
    '  counter:      { kind: resources,   app: counter, port: 0 }',
    '  simple_agent: { kind: agent,       app: simple, port: 0,',
    '                  model_server: policy, resources_server: weather }',
    '  env:          { kind: environment, app: single_agent_turn, port: 0,',
    '                  agent_server: simple_agent, resources_server: weather }',
    '  # The counter pair: its session state is exported at a checkpoint and restored.',
    '  counter_agent: { kind: agent,      app: simple, port: 0,',
    '                  model_server: policy, resources_server: counter }',
    '  counter_env:  { kind: environment, app: single_agent_turn, port: 0,',
    '                  agent_server: counter_agent, resources_server: counter }',
    '',
  ].join('\n');
}

interface CallView {
  rollout_id: string | null;
  n_messages: number;
  held: boolean;
  returned: boolean;
  dropped: boolean;
}

async function backend<T>(url: string, path: string, body?: unknown): Promise<T> {
  const reply = await fetch(`${url}${path}`, {
    method: body === undefined ? 'GET' : 'POST',
    headers: { 'content-type': 'application/json' },
    ...(body === undefined ? {} : { body: JSON.stringify(body) }),
  });
  if (!reply.ok) throw new Error(`${path}: HTTP ${reply.status} ${await reply.text()}`);
  return (await reply.json()) as T;
}

async function calls(url: string): Promise<CallView[]> {
  return (await backend<{ calls: CallView[] }>(url, '/_ctl/calls')).calls;
}

async function until(what: string, check: () => Promise<boolean> | boolean): Promise<void> {
  const deadline = Date.now() + WAIT_MS;
  while (!(await check())) {
    if (Date.now() > deadline) throw new CliFailure(`demo: timed out waiting for ${what}`);
    await new Promise((done) => setTimeout(done, 50));
  }
}

/** Delivered calls of one rollout made again at the same conversation length. */
export function repeatedCalls(log: readonly CallView[]): number {
  const seen = new Set<string>();
  let repeated = 0;
  for (const call of log) {
    if (!call.returned || call.rollout_id === null) continue;
    const key = `${call.rollout_id}\u0000${call.n_messages}`;
    if (seen.has(key)) repeated += 1;
    seen.add(key);
  }
  return repeated;
}

export interface DemoOptions {
  readonly rollouts: number;
  /** Holds the stack file, run directory, checkpoints and results. */
  readonly workDir: string;
  readonly io: CliIo;
  readonly progress: (line: string) => void;
}

/** Runs the demo; the stack it starts is stopped before this returns, whatever happened. */
export async function runDemo(opts: DemoOptions): Promise<DemoReport> {
  const { workDir, progress } = opts;
  const n = opts.rollouts;
  const started = performance.now();
  const seconds: Record<string, number> = {};
  const lap = (stage: string, since: number) => {
    seconds[stage] = Number(((performance.now() - since) / 1000).toFixed(3));
  };
  const configPath = join(workDir, 'demo-stack.yaml');
  writeFileSync(configPath, demoStackText(await freePort('127.0.0.1'), generatedId('demo')));
  const env = { ...opts.io.env } as NodeJS.ProcessEnv;

  progress('starting the stack (inference, resources, model, agent, environment) …');
  let stack: StackHandle | undefined;
  const contexts: CommandContext[] = [];
  const context = (argv: string[]) => {
    const parsed = parseCommandLine([...argv, '--config', join(workDir, 'run', 'stack.yaml')]);
    if (parsed.kind !== 'invoke')
      throw new Error(`demo: bad internal command line ${argv.join(' ')}`);
    const ctx = new CommandContext(parsed.invocation, { ...opts.io, cwd: workDir });
    contexts.push(ctx);
    return ctx;
  };
  let all: Collector[] = [];
  try {
    let since = performance.now();
    stack = await launchStack({ configPath, runDir: join(workDir, 'run'), env });
    lap('start', since);
    const backendUrl = stack.servers.get('inference')!.url;
    const ctx = context(['checkpoint', '--dir', 'checkpoint', '--stop']);

    const results = new Map<string, ResultRow[]>();
    const lost = new Map<string, Dispatch>();
    // Even rollouts are weather tasks, odd ones counter tasks, each set on its own environment.
    const tasks = new Map(
      Array.from({ length: n }, (_, i): [string, { set: Taskset; task: TaskSpec }] =>
        i % 2 === 0
          ? [`weather-${i}`, { set: 'weather', task: weatherTask(i) }]
          : [`counter-${i}`, { set: 'counter', task: counterTask(i) }],
      ),
    );
    const collectors: Record<Taskset, Collector> = {
      weather: collector('env'),
      counter: collector('counter_env'),
    };
    function collector(env: string): Collector {
      return new Collector({
        envUrl: stack!.servers.get(env)!.url,
        concurrency: n,
        client: ctx.clients.data,
        onResult: (row) => {
          results.set(row.rollout_id, [...(results.get(row.rollout_id) ?? []), row]);
        },
        onLost: (dispatch) => lost.set(dispatch.episode.rollout_id, dispatch),
      });
    }
    all = Object.values(collectors);
    const send = (episodes: readonly EpisodeId[]) => {
      for (const episode of episodes) {
        const { set, task } = tasks.get(episode.rollout_id)!;
        collectors[set].enqueue([{ episode, task }]);
      }
    };
    const settled = () => Promise.all(all.map((c) => c.settled()));
    for (const [rollout, { set }] of tasks) {
      if (set === 'counter')
        await backend(backendUrl, '/_ctl/script', { script: 'counter', rollout });
    }

    // Every rollout waits at its second model call.
    await backend(backendUrl, '/_ctl/hold', { after_calls_per_rollout: 1 });
    progress(`dispatching ${n} rollouts …`);
    since = performance.now();
    send([...tasks.keys()].map((rollout_id) => ({ rollout_id, attempt: 0 })));
    const waiting = async () =>
      (await calls(backendUrl)).filter((c) => c.held && !c.returned && !c.dropped).length;
    await until(
      'every rollout to reach its second model call',
      async () => (await waiting()) === n,
    );
    // A quarter finishes before the checkpoint. A released weather call ends its rollout; a
    // released counter call is followed by its third, which the hold catches again.
    const early = Math.floor(n / 4);
    while (results.size < early) {
      const before = { results: results.size, calls: (await calls(backendUrl)).length };
      await backend(backendUrl, '/_ctl/step', { calls: 1 });
      await until(
        'the released call to end its rollout or to be followed by the next',
        async () =>
          results.size > before.results || (await calls(backendUrl)).length > before.calls,
      );
    }
    const finishedBefore = results.size;
    lap('in_flight', since);
    progress(`${finishedBefore} finished, ${n - finishedBefore} mid-flight: checkpoint …`);

    since = performance.now();
    const cut = await checkpointCommand(ctx);
    if (cut.exitCode !== 0) throw new CliFailure(`demo: the checkpoint failed:\n${cut.text}`);
    lap('checkpoint', since);
    const checkpointDir = join(workDir, 'checkpoint');
    const record = JSON.parse(
      await readFile(join(checkpointDir, CONTROLLER_FILE), 'utf8'),
    ) as ControllerRecord;

    progress('SIGKILL every gym process (the inference backend survives) …');
    since = performance.now();
    await stack.crash();
    await settled();
    lap('crash', since);
    progress('fresh processes …');
    since = performance.now();
    await stack.restart();
    lap('restart', since);

    progress('restore …');
    since = performance.now();
    const restoreCtx = context(['restore', '--dir', 'checkpoint']);
    const restored = await restoreCommand(restoreCtx);
    if (restored.exitCode !== 0)
      throw new CliFailure(`demo: the restore failed:\n${restored.text}`);
    const restoreId = String(restored.data.checkpoint_id);
    const participants = await restoreCtx.participants();
    await resume(participants, restoreId, restoreCtx.deadlineTs());
    lap('restore', since);
    await backend(backendUrl, '/_ctl/release', {});

    // Continued: the checkpoint's scope, as their next attempt. Everything else still without a
    // result started over: retired at the attempt that ran, re-sent from its input.
    const scope = record.episode_ids.map(parseCaptureKey);
    const continued = scope.filter((e) => !results.has(e.rollout_id));
    const inScope = new Set(scope.map((e) => e.rollout_id));
    const restarts: EpisodeId[] = [...lost.values()]
      .map((d) => d.episode)
      .filter((e) => !inScope.has(e.rollout_id) && !results.has(e.rollout_id));
    if (restarts.length > 0) {
      await retire(participants, generatedId('retire'), restarts, restoreCtx.deadlineTs());
    }
    progress(`${continued.length} continued, ${restarts.length} restarted …`);
    since = performance.now();
    send([...continued, ...restarts].map(nextAttempt));
    await settled();
    lap('finish', since);
    await forget(participants, generatedId('forget'), [...tasks.keys()], restoreCtx.deadlineTs());

    const log = await calls(backendUrl);
    const tagged = log.filter((c) => c.rollout_id !== null);
    const rewards: Record<string, number> = {};
    const notOnce: string[] = [];
    for (const id of tasks.keys()) {
      const rows = results.get(id) ?? [];
      if (rows.length !== 1) notOnce.push(id);
      for (const row of rows) {
        const reward = row.failure === null ? String(row.result?.reward ?? 'none') : 'failed';
        rewards[reward] = (rewards[reward] ?? 0) + 1;
      }
    }
    const repeated = repeatedCalls(tagged);
    seconds.total = Number(((performance.now() - started) / 1000).toFixed(3));
    return {
      rollouts: n,
      tasksets: Object.fromEntries(
        Object.keys(collectors).map((set) => [
          set,
          [...tasks.values()].filter((t) => t.set === set).length,
        ]),
      ),
      checkpoint_id: record.checkpoint_id,
      finished_before_checkpoint: finishedBefore,
      continued: continued.length,
      restarted: restarts.length,
      model_calls: tagged.length,
      delivered_model_calls: tagged.filter((c) => c.returned).length,
      minimum_model_calls: [...tasks.values()].reduce((sum, t) => sum + MODEL_CALLS[t.set], 0),
      repeated_model_calls: repeated,
      not_exactly_once: notOnce,
      rewards,
      seconds,
      ok: notOnce.length === 0 && rewards['1'] === n && repeated === 0,
    };
  } catch (err) {
    if (err instanceof CliFailure) throw err;
    throw new CliFailure(`demo: ${describe(err)}`);
  } finally {
    for (const collector of all) collector.abort();
    for (const ctx of contexts) ctx.close();
    await stack?.stop({ graceMs: 5000 });
  }
}
