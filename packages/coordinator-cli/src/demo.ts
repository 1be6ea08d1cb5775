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
 *
 * With `--tools mcp` the agents take their tools over MCP. An episode that grants MCP access is a
 * restart (no checkpoint continues an agent holding an MCP token), so every rollout in flight at
 * the crash starts over; only the continued rollouts are held to repeating no model call.
 */
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';

import { forget, type Participants, resume, retire } from '@ckpt-gym/core/client';
import { type EpisodeId, nextAttempt, parseCaptureKey } from '@ckpt-gym/core/protocol';

import { type DemoToolTransport, parseCommandLine } from './args.js';
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
  /** How the agents took their tools. */
  readonly tools: DemoToolTransport;
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
  /**
   * Delivered calls made again for the same rollout at the same conversation length, among the
   * rollouts that did not start over (a restart makes its calls again by design).
   */
  readonly repeated_model_calls: number;
  /** Rollouts with no result, or more than one. */
  readonly not_exactly_once: string[];
  /** Reward → number of rollouts. */
  readonly rewards: Record<string, number>;
  readonly seconds: Record<string, number>;
  readonly ok: boolean;
}

/** The settings each kind of server gets for the demo's tool transport (none for direct HTTP). */
function toolSettings(tools: DemoToolTransport): Record<'resources' | 'agent' | 'env', string> {
  return tools === 'mcp'
    ? {
        resources: ', expose_tools_over_mcp: true',
        agent: ', tool_transport: mcp',
        env: ', resources_tool_transports: [mcp]',
      }
    : { resources: '', agent: '', env: '' };
}

/** The embedded stack: every port free at run time; the backend's is fixed first (its URL is config). */
export function demoStackText(
  backendPort: number,
  token: string,
  tools: DemoToolTransport = 'direct_http',
): string {
  const add = toolSettings(tools);
  return [
    '# The demo stack (written by ckpt-gym demo).',
    `checkpoint: { enabled: true, control_auth_token: ${token}, lease_grace_seconds: 600 }`,
    'token_capture: { enabled: true, dir: ./capture }',
    'servers:',
    `  inference:    { kind: inference,   app: fake, port: ${backendPort} }`,
    '  policy:       { kind: model,       app: policy, port: 0,',
    `                  backend_url: "http://127.0.0.1:${backendPort}/v1",`,
    '                  checkpoint_policy: true, checkpoint_generation_cuts: true }',
    `  weather:      { kind: resources,   app: weather, port: 0${add.resources} }`,
    `  counter:      { kind: resources,   app: counter, port: 0${add.resources} }`,
    '  simple_agent: { kind: agent,       app: simple, port: 0,',
    `                  model_server: policy, resources_server: weather${add.agent} }`,
    '  env:          { kind: environment, app: single_agent_turn, port: 0,',
    `                  agent_server: simple_agent, resources_server: weather${add.env} }`,
    '  # The counter pair: its session state is exported at a checkpoint and restored.',
    '  counter_agent: { kind: agent,      app: simple, port: 0,',
    `                  model_server: policy, resources_server: counter${add.agent} }`,
    '  counter_env:  { kind: environment, app: single_agent_turn, port: 0,',
    `                  agent_server: counter_agent, resources_server: counter${add.env} }`,
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

/**
 * Delivered calls of one rollout made again at the same conversation length; the rollouts in
 * `startedOver` make their calls again by design and are not counted.
 */
export function repeatedCalls(
  log: readonly CallView[],
  startedOver: ReadonlySet<string> = new Set(),
): number {
  const seen = new Set<string>();
  let repeated = 0;
  for (const call of log) {
    if (!call.returned || call.rollout_id === null || startedOver.has(call.rollout_id)) continue;
    const key = `${call.rollout_id}\u0000${call.n_messages}`;
    if (seen.has(key)) repeated += 1;
    seen.add(key);
  }
  return repeated;
}

export interface DemoOptions {
  readonly rollouts: number;
  /** How the agents take their tools (default direct HTTP). */
  readonly tools?: DemoToolTransport;
  /** Holds the stack file, run directory, checkpoints and results. */
  readonly workDir: string;
  readonly io: CliIo;
  readonly progress: (line: string) => void;
}

/** One rollout of the demo: its taskset and task. */
interface DemoTask {
  readonly set: Taskset;
  readonly task: TaskSpec;
}

/** Even rollouts are weather tasks, odd ones counter tasks, each set on its own environment. */
function demoTasks(n: number): Map<string, DemoTask> {
  return new Map(
    Array.from({ length: n }, (_, i): [string, DemoTask] =>
      i % 2 === 0
        ? [`weather-${i}`, { set: 'weather', task: weatherTask(i) }]
        : [`counter-${i}`, { set: 'counter', task: counterTask(i) }],
    ),
  );
}

/** What the restore leaves to finish: the checkpoint's scope continues, the rest starts over. */
interface Continuation {
  readonly continued: EpisodeId[];
  readonly restarts: EpisodeId[];
}

/** The restore's context and the participants it found. */
interface Restored {
  readonly ctx: CommandContext;
  readonly participants: Participants;
}

/**
 * One demo run, stage by stage: the stack, the collectors, the results and the stage timings.
 * `runDemo` calls the stages in order and `close` releases everything, whatever happened.
 */
class DemoRun {
  readonly n: number;
  readonly tasks: Map<string, DemoTask>;
  readonly results = new Map<string, ResultRow[]>();
  readonly lost = new Map<string, Dispatch>();
  readonly seconds: Record<string, number> = {};
  readonly #started = performance.now();
  readonly #contexts: CommandContext[] = [];
  #stack: StackHandle | undefined;
  #collectors: Record<Taskset, Collector> | undefined;

  get tools(): DemoToolTransport {
    return this.opts.tools ?? 'direct_http';
  }

  constructor(private readonly opts: DemoOptions) {
    this.n = opts.rollouts;
    this.tasks = demoTasks(this.n);
  }

  get stack(): StackHandle {
    if (!this.#stack) throw new Error('demo: the stack is not started');
    return this.#stack;
  }

  get backendUrl(): string {
    return this.stack.servers.get('inference')!.url;
  }

  /** Times `stage` (seconds, as the report has them). */
  async lap<T>(stage: string, run: () => Promise<T>): Promise<T> {
    const since = performance.now();
    const result = await run();
    this.seconds[stage] = Number(((performance.now() - since) / 1000).toFixed(3));
    return result;
  }

  totalSeconds(): number {
    return Number(((performance.now() - this.#started) / 1000).toFixed(3));
  }

  /** A command's context on the run's resolved stack file, closed with the run. */
  context(argv: string[]): CommandContext {
    const { workDir } = this.opts;
    const parsed = parseCommandLine([...argv, '--config', join(workDir, 'run', 'stack.yaml')]);
    if (parsed.kind !== 'invoke')
      throw new Error(`demo: bad internal command line ${argv.join(' ')}`);
    const ctx = new CommandContext(parsed.invocation, { ...this.opts.io, cwd: workDir });
    this.#contexts.push(ctx);
    return ctx;
  }

  async start(): Promise<void> {
    const { workDir } = this.opts;
    const configPath = join(workDir, 'demo-stack.yaml');
    const text = demoStackText(await freePort('127.0.0.1'), generatedId('demo'), this.tools);
    writeFileSync(configPath, text);
    const env = { ...this.opts.io.env } as NodeJS.ProcessEnv;
    this.#stack = await launchStack({ configPath, runDir: join(workDir, 'run'), env });
  }

  /** The collectors, one per environment, on `ctx`'s data client. */
  collect(ctx: CommandContext): void {
    const collector = (env: string) =>
      new Collector({
        envUrl: this.stack.servers.get(env)!.url,
        concurrency: this.n,
        client: ctx.clients.data,
        onResult: (row) => {
          this.results.set(row.rollout_id, [...(this.results.get(row.rollout_id) ?? []), row]);
        },
        onLost: (dispatch) => this.lost.set(dispatch.episode.rollout_id, dispatch),
      });
    this.#collectors = { weather: collector('env'), counter: collector('counter_env') };
  }

  send(episodes: readonly EpisodeId[]): void {
    for (const episode of episodes) {
      const { set, task } = this.tasks.get(episode.rollout_id)!;
      this.#collectors![set].enqueue([{ episode, task }]);
    }
  }

  async settled(): Promise<void> {
    await Promise.all(Object.values(this.#collectors ?? {}).map((c) => c.settled()));
  }

  /** Counter rollouts get the counter script; every rollout is held at its second model call. */
  async holdAtSecondCall(): Promise<void> {
    for (const [rollout, { set }] of this.tasks) {
      if (set === 'counter')
        await backend(this.backendUrl, '/_ctl/script', { script: 'counter', rollout });
    }
    await backend(this.backendUrl, '/_ctl/hold', { after_calls_per_rollout: 1 });
  }

  /** Every rollout dispatched up to its held call; a quarter then let finish. */
  async dispatch(): Promise<number> {
    const url = this.backendUrl;
    this.send([...this.tasks.keys()].map((rollout_id) => ({ rollout_id, attempt: 0 })));
    const waiting = async () =>
      (await calls(url)).filter((c) => c.held && !c.returned && !c.dropped).length;
    await until(
      'every rollout to reach its second model call',
      async () => (await waiting()) === this.n,
    );
    // A quarter finishes before the checkpoint. A released weather call ends its rollout; a
    // released counter call is followed by its third, which the hold catches again.
    const early = Math.floor(this.n / 4);
    while (this.results.size < early) {
      const before = { results: this.results.size, calls: (await calls(url)).length };
      await backend(url, '/_ctl/step', { calls: 1 });
      await until(
        'the released call to end its rollout or to be followed by the next',
        async () => this.results.size > before.results || (await calls(url)).length > before.calls,
      );
    }
    return this.results.size;
  }

  /** Restores the checkpoint into the fresh processes and resumes them. */
  async restore(): Promise<Restored> {
    const ctx = this.context(['restore', '--dir', 'checkpoint']);
    const restored = await restoreCommand(ctx);
    if (restored.exitCode !== 0)
      throw new CliFailure(`demo: the restore failed:\n${restored.text}`);
    const participants = await ctx.participants();
    await resume(participants, String(restored.data.checkpoint_id), ctx.deadlineTs());
    return { ctx, participants };
  }

  /**
   * Releases the backend; what is left to finish: the checkpoint's scope continues as its next
   * attempt, everything else still without a result starts over (retired at the attempt that
   * ran, re-sent from its input).
   */
  async continuation(record: ControllerRecord, { ctx, participants }: Restored) {
    await backend(this.backendUrl, '/_ctl/release', {});
    const scope = record.episode_ids.map(parseCaptureKey);
    const continued = scope.filter((e) => !this.results.has(e.rollout_id));
    const inScope = new Set(scope.map((e) => e.rollout_id));
    const restarts: EpisodeId[] = [...this.lost.values()]
      .map((d) => d.episode)
      .filter((e) => !inScope.has(e.rollout_id) && !this.results.has(e.rollout_id));
    if (restarts.length > 0) {
      await retire(participants, generatedId('retire'), restarts, ctx.deadlineTs());
    }
    return { continued, restarts } satisfies Continuation;
  }

  async close(): Promise<void> {
    for (const collector of Object.values(this.#collectors ?? {})) collector.abort();
    for (const ctx of this.#contexts) ctx.close();
    await this.#stack?.stop({ graceMs: 5000 });
  }
}

/** The report, from the results and the backend's call log. */
function demoReport(
  run: DemoRun,
  log: readonly CallView[],
  facts: Continuation & { checkpointId: string; finishedBefore: number },
): DemoReport {
  const tasks = [...run.tasks.values()];
  const tagged = log.filter((c) => c.rollout_id !== null);
  const rewards: Record<string, number> = {};
  const notOnce: string[] = [];
  for (const id of run.tasks.keys()) {
    const rows = run.results.get(id) ?? [];
    if (rows.length !== 1) notOnce.push(id);
    for (const row of rows) {
      const reward = row.failure === null ? String(row.result?.reward ?? 'none') : 'failed';
      rewards[reward] = (rewards[reward] ?? 0) + 1;
    }
  }
  const repeated = repeatedCalls(tagged, new Set(facts.restarts.map((e) => e.rollout_id)));
  return {
    rollouts: run.n,
    tools: run.tools,
    tasksets: Object.fromEntries(
      Object.keys(MODEL_CALLS).map((set) => [set, tasks.filter((t) => t.set === set).length]),
    ),
    checkpoint_id: facts.checkpointId,
    finished_before_checkpoint: facts.finishedBefore,
    continued: facts.continued.length,
    restarted: facts.restarts.length,
    model_calls: tagged.length,
    delivered_model_calls: tagged.filter((c) => c.returned).length,
    minimum_model_calls: tasks.reduce((sum, t) => sum + MODEL_CALLS[t.set], 0),
    repeated_model_calls: repeated,
    not_exactly_once: notOnce,
    rewards,
    seconds: { ...run.seconds, total: run.totalSeconds() },
    ok: notOnce.length === 0 && rewards['1'] === run.n && repeated === 0,
  };
}

/** Runs the demo; the stack it starts is stopped before this returns, whatever happened. */
export async function runDemo(opts: DemoOptions): Promise<DemoReport> {
  const { workDir, progress } = opts;
  const run = new DemoRun(opts);
  progress('starting the stack (inference, resources, model, agent, environment) …');
  try {
    await run.lap('start', () => run.start());
    const ctx = run.context(['checkpoint', '--dir', 'checkpoint', '--stop']);
    run.collect(ctx);
    await run.holdAtSecondCall();
    progress(`dispatching ${run.n} rollouts …`);
    const finishedBefore = await run.lap('in_flight', () => run.dispatch());
    progress(`${finishedBefore} finished, ${run.n - finishedBefore} mid-flight: checkpoint …`);
    await run.lap('checkpoint', async () => {
      const cut = await checkpointCommand(ctx);
      if (cut.exitCode !== 0) throw new CliFailure(`demo: the checkpoint failed:\n${cut.text}`);
    });
    const record = JSON.parse(
      await readFile(join(workDir, 'checkpoint', CONTROLLER_FILE), 'utf8'),
    ) as ControllerRecord;

    progress('SIGKILL every gym process (the inference backend survives) …');
    await run.lap('crash', async () => {
      await run.stack.crash();
      await run.settled();
    });
    progress('fresh processes …');
    await run.lap('restart', () => run.stack.restart());
    progress('restore …');
    const restored = await run.lap('restore', () => run.restore());
    const left = await run.continuation(record, restored);
    progress(`${left.continued.length} continued, ${left.restarts.length} restarted …`);
    await run.lap('finish', async () => {
      run.send([...left.continued, ...left.restarts].map(nextAttempt));
      await run.settled();
    });
    const keys = [...run.tasks.keys()];
    await forget(restored.participants, generatedId('forget'), keys, restored.ctx.deadlineTs());
    const log = await calls(run.backendUrl);
    return demoReport(run, log, { ...left, checkpointId: record.checkpoint_id, finishedBefore });
  } catch (err) {
    if (err instanceof CliFailure) throw err;
    throw new CliFailure(`demo: ${describe(err)}`);
  } finally {
    await run.close();
  }
}
