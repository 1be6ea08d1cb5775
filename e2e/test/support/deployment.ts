/**
 * A deployment for one e2e test: a stack of real server processes started by the CLI's launcher
 * from a generated stack file, each in its own process group. `crash()` SIGKILLs every gym process
 * group while the fake backend lives on; `restart()` starts fresh gym processes on the same ports.
 * The test plays the controller through core's coordination functions.
 *
 * Every deployment registers itself: `closeAll()` (afterEach, which also runs after a jest timeout)
 * kills what is left, SIGKILL as the fallback, and removes the run directory. `scenario()` prints
 * every server's log when its test fails, then closes them: the logs live in the run directory, so
 * a scenario's deployment is closed by the scenario, not by `await using` (which would remove them
 * first). A deployment outside a scenario is `AsyncDisposable`.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import {
  CLI_MAIN,
  freePort,
  launchStack,
  type LaunchedServer,
  type StackHandle,
} from '@ckpt-gym/coordinator-cli';
import {
  commit,
  createHttpClients,
  createParticipants,
  forget,
  getControl,
  type HttpClients,
  type Participants,
  prepare,
  type PrepareResult,
  type Replies,
  restore,
  resume,
} from '@ckpt-gym/core/client';
import { captureKey, type EpisodeId } from '@ckpt-gym/core/protocol';
import { type ParticipantKind, readParticipantState } from '@ckpt-gym/core/server';
import { deadline, type Status, tracked, until } from '@ckpt-gym/testing';

import { stackYaml, type StackOptions, type StackShape, TOKEN } from './stacks.js';

export type Json = Record<string, unknown>;

/** One call the fake backend saw (its `/_ctl/calls` view). */
export interface CallView {
  index: number;
  capture_key: string | null;
  rollout_id: string | null;
  attempt: number | null;
  n_messages: number;
  admission: unknown;
  held: boolean;
  returned: boolean;
  dropped: boolean;
  continued_from: string | null;
  /** The `x-request-id` the call arrived with. */
  request_id: string | null;
}

/** A CLI process: its exit code once it exits, and everything it printed so far. */
export interface CliRun {
  readonly child: ChildProcess;
  readonly exited: Promise<number | null>;
  output(): string;
}

/** A `/run` in flight: its reply (status and body) and whether it came back yet. */
export interface RunHandle {
  readonly reply: Promise<{ status: number; body: Json }>;
  done(): boolean;
}

const PARTICIPANT_KINDS = new Set(['environment', 'model', 'agent', 'resources']);
const live = new Set<Deployment>();
const LOG_TAIL_LINES = 80;
/** A failure's summary repeats each server's newest warnings, cut short. */
const WARNING_LINES = 15;
const WARNING_CHARS = 400;

export class Deployment implements AsyncDisposable {
  readonly clients: HttpClients = createHttpClients();
  readonly token = TOKEN;
  private closed = false;

  private constructor(
    readonly shape: StackShape,
    readonly runDir: string,
    readonly handle: StackHandle,
  ) {}

  /** Starts every server of `shape` (the fake backend first) in a fresh run directory. */
  static async start(shape: StackShape, options: StackOptions = {}): Promise<Deployment> {
    const runDir = await mkdtemp(join(tmpdir(), `ckpt-gym-e2e-${shape}-`));
    const configPath = join(runDir, 'stack.source.yaml');
    await writeFile(
      configPath,
      await withPorts(stackYaml(shape, await freePort('127.0.0.1'), options)),
    );
    let handle: StackHandle;
    try {
      handle = await launchStack({ configPath, runDir });
    } catch (err) {
      // The launcher stops what it started when it fails; the logs say why.
      process.stderr.write(`launch of ${shape} failed in ${runDir}:\n${logTails(runDir)}\n`);
      await rm(runDir, { recursive: true, force: true });
      throw err;
    }
    const deployment = new Deployment(shape, runDir, handle);
    live.add(deployment);
    return deployment;
  }

  server(name: string): LaunchedServer {
    const found = this.handle.servers.get(name);
    if (!found) throw new Error(`no server ${name} in this ${this.shape} deployment`);
    return found;
  }

  url(name: string): string {
    return this.server(name).url;
  }

  /** Names of the gym servers (every server but the inference backend). */
  gymServers(): LaunchedServer[] {
    return [...this.handle.servers.values()].filter((s) => s.kind !== 'inference');
  }

  // --- the fake backend ----------------------------------------------------------------------

  get backendUrl(): string {
    return this.url('inference');
  }

  /** POST (with `body`) or GET a backend control route. */
  async backend<T = Json>(path: string, body?: Json): Promise<T> {
    const url = `${this.backendUrl}${path}`;
    return body === undefined
      ? this.clients.data(url, { retry: { limit: 0 } }).json<T>()
      : this.clients.data.post(url, { json: body, retry: { limit: 0 } }).json<T>();
  }

  async calls(): Promise<CallView[]> {
    return (await this.backend<{ calls: CallView[] }>('/_ctl/calls')).calls;
  }

  async callCount(): Promise<number> {
    return (await this.backend<{ count: number }>('/_ctl/call_count')).count;
  }

  async waitForCalls(count: number, timeoutMs = 30_000): Promise<void> {
    await until(async () => (await this.callCount()) >= count, `${count} model calls`, timeoutMs);
  }

  /** How many model calls wait at the backend now (held, or behind its gate). */
  async waitingCalls(): Promise<number> {
    return (await this.backend<{ waiting: number }>('/_ctl/call_count')).waiting;
  }

  /**
   * Holds every rollout's second model call at the backend, starts each of `rollouts` on the
   * environment (`episode` builds its `/run` body), and waits until every one waits there: all
   * in flight between their two model calls.
   */
  async startHeldAtSecondCall(
    rollouts: readonly string[],
    episode: (rolloutId: string) => Json,
    timeoutMs = 60_000,
  ): Promise<RunHandle[]> {
    await this.backend('/_ctl/hold', { after_calls_per_rollout: 1 });
    const runs = rollouts.map((r) => this.post('env', '/run', episode(r)));
    const held = `${rollouts.length} model calls held`;
    await until(async () => (await this.waitingCalls()) >= rollouts.length, held, timeoutMs);
    return runs;
  }

  /** `n_messages` of every call the backend saw, in arrival order. */
  async messageCounts(): Promise<number[]> {
    return (await this.calls()).map((call) => call.n_messages);
  }

  // --- data plane ----------------------------------------------------------------------------

  /** POSTs `body` to `path` on `server`; the reply resolves with any status (never retried). */
  post(server: string, path: string, body: Json): RunHandle {
    let finished = false;
    const reply = this.clients.data
      .post(`${this.url(server)}${path}`, {
        json: body,
        retry: { limit: 0 },
        throwHttpErrors: false,
        timeout: { request: 110_000 },
      })
      .then((res) => ({ status: res.statusCode, body: parseBody(res.body) }))
      .finally(() => {
        finished = true;
      });
    // A crash cuts the connection: the test reads the rejection only when it awaits the reply.
    reply.catch(() => undefined);
    return { reply, done: () => finished };
  }

  // --- control plane -------------------------------------------------------------------------

  participants(): Participants {
    const members = this.gymServers()
      .filter((s) => PARTICIPANT_KINDS.has(s.kind))
      .map((s) => ({ server: s.name, kind: s.kind as ParticipantKind, url: s.url }));
    return createParticipants(members, { token: this.token, clients: this.clients });
  }

  async status(name: string): Promise<Status> {
    return (await getControl(
      this.clients.control,
      `${this.url(name)}/ng-control/v1/checkpoint/status`,
      { token: this.token, timeoutMs: 10_000 },
    )) as Status;
  }

  async statuses(): Promise<Record<string, Status>> {
    const names = this.gymServers().map((s) => s.name);
    const replies = await Promise.all(names.map((name) => this.status(name)));
    return Object.fromEntries(names.map((name, i) => [name, replies[i] as Status]));
  }

  /** Prepare (must be prepared) and commit `episodes` into `<run dir>/<id>`. */
  async checkpoint(
    id: string,
    episodes: readonly EpisodeId[],
  ): Promise<{ prepared: PrepareResult; committed: Replies; dir: string }> {
    const by = deadline(30);
    const participants = this.participants();
    const prepared = await prepare(participants, id, by);
    if (!prepared.prepared) {
      throw new Error(`checkpoint ${id} not prepared: ${JSON.stringify(prepared.blockers())}`);
    }
    const dir = this.checkpointDir(id);
    const committed = await commit(participants, id, dir, prepared.continued(episodes), by);
    return { prepared, committed, dir };
  }

  /** Every record of one participant in checkpoint `id`, read back and verified against its manifest. */
  async records(id: string, kind: string, instance: string): Promise<Json[]> {
    const { records } = await readParticipantState<Json>({
      checkpointDir: this.checkpointDir(id),
      kind,
      instance,
      select: () => true,
      validate: (record) => record as Json,
    });
    return records;
  }

  checkpointDir(id: string): string {
    return join(this.runDir, 'checkpoints', id);
  }

  async resume(id: string): Promise<Replies> {
    return resume(this.participants(), id, deadline(30));
  }

  /**
   * What every server still tracks once `rollouts` are done for good: first only the marks a
   * restore or retire left for replaced attempts, then, after `forget`, nothing at all.
   */
  async trackedAfterForget(
    rollouts: readonly string[],
  ): Promise<Record<string, Record<string, number>>> {
    const before = tracked(await this.statuses());
    const onlyMarks = Object.values(before).every((left) =>
      Object.keys(left).every((key) => key === 'retired_rollouts' || key === 'retired_sessions'),
    );
    if (!onlyMarks) return before;
    await forget(this.participants(), `forget-${rollouts.join('-')}`, rollouts, deadline(30));
    return tracked(await this.statuses());
  }

  /** Every gym process group dies at once (SIGKILL); the fake backend lives on. */
  async crash(): Promise<void> {
    await this.handle.crash();
  }

  /** Fresh gym processes on the same ports (after a crash). */
  async restart(): Promise<void> {
    await this.handle.restart();
  }

  /**
   * Crash, release the backend's held calls, start fresh gym processes, restore the checkpoint
   * `from` for `episodes` (optionally without the participants of `skipKinds`) and resume.
   */
  async crashAndRestore(
    from: string,
    episodes: readonly EpisodeId[],
    options: {
      restoreId?: string;
      skipKinds?: readonly string[];
      beforeRestart?: () => Promise<void>;
    } = {},
  ): Promise<Replies> {
    await this.crash();
    await this.backend('/_ctl/release', {});
    await options.beforeRestart?.();
    await this.restart();
    const restoreId = options.restoreId ?? `${from}-restore`;
    const all = this.participants();
    const participants = createParticipants(
      all.members.filter((m) => !(options.skipKinds ?? []).includes(m.kind)),
      { token: this.token, clients: this.clients },
    );
    const by = deadline(30);
    const restored = await restore(participants, restoreId, this.checkpointDir(from), episodes, by);
    await resume(participants, restoreId, by);
    return restored;
  }

  // --- the coordinator CLI -------------------------------------------------------------------

  /**
   * Runs `ckpt-gym <args>` (the built bin) against this stack's resolved stack file, output to
   * `<run dir>/logs/cli-<n>.log`; killed with the deployment.
   */
  cli(args: readonly string[]): CliRun {
    const logPath = join(this.runDir, 'logs', `cli-${this.cliRuns.length + 1}.log`);
    const child = spawn(process.execPath, [CLI_MAIN, ...args, '--config', this.handle.configPath], {
      cwd: this.runDir,
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    this.children.add(child);
    let output = '';
    const collect = (chunk: Buffer) => {
      output += chunk.toString('utf8');
    };
    child.stdout?.on('data', collect);
    child.stderr?.on('data', collect);
    const exited = new Promise<number | null>((resolveExit) => {
      child.once('exit', (code) => {
        this.children.delete(child);
        writeFileSync(logPath, output);
        resolveExit(code);
      });
    });
    const run = { child, exited, output: () => output };
    this.cliRuns.push(run);
    return run;
  }

  private readonly children = new Set<ChildProcess>();
  private readonly cliRuns: CliRun[] = [];

  // --- teardown and logs ---------------------------------------------------------------------

  /** Every server's warn and error lines (the newest WARNING_LINES, each cut to WARNING_CHARS). */
  warnings(): string {
    return [...this.handle.servers.values()]
      .map((s) => {
        const lines = existsSync(s.logPath)
          ? readFileSync(s.logPath, 'utf8')
              .split('\n')
              .filter((line) => /"level":"(warn|error)"/.test(line))
          : [];
        return lines.length === 0
          ? ''
          : `----- ${s.name}\n${lines
              .slice(-WARNING_LINES)
              .map((line) => line.slice(0, WARNING_CHARS))
              .join('\n')}`;
      })
      .filter((text) => text !== '')
      .join('\n');
  }

  logTails(): string {
    const cli = this.cliRuns.map((run, i) => `----- ckpt-gym run ${i + 1}\n${run.output()}`);
    return [logTails(this.runDir, [...this.handle.servers.values()]), ...cli].join('\n');
  }

  /** SIGKILL to every process this deployment started (synchronous: safe in an exit handler). */
  killAll(): void {
    for (const child of this.children) child.kill('SIGKILL');
    for (const s of this.handle.servers.values()) killGroup(s.pid);
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    live.delete(this);
    try {
      for (const child of this.children) child.kill('SIGKILL');
      await this.handle.stop({ graceMs: 0 });
    } finally {
      this.killAll();
      this.clients.close();
      await rm(this.runDir, { recursive: true, force: true });
    }
  }
}

/** The generated stack text (one server per line) with a test port for every `port: 0`. */
async function withPorts(text: string): Promise<string> {
  const lines = text.split('\n');
  for (const [i, line] of lines.entries()) {
    if (line.includes(' port: 0,'))
      lines[i] = line.replace(' port: 0,', ` port: ${await freePort('127.0.0.1')},`);
  }
  return lines.join('\n');
}

function parseBody(text: string): Json {
  try {
    const parsed = JSON.parse(text) as unknown;
    return typeof parsed === 'object' && parsed !== null ? (parsed as Json) : { value: parsed };
  } catch {
    return { text };
  }
}

function killGroup(pid: number): void {
  for (const target of [-pid, pid]) {
    try {
      process.kill(target, 'SIGKILL');
    } catch {
      // Already gone.
    }
  }
}

function tail(path: string): string {
  if (!existsSync(path)) return '(no log)';
  const lines = readFileSync(path, 'utf8').split('\n');
  return lines.slice(-LOG_TAIL_LINES).join('\n');
}

function logTails(runDir: string, servers: readonly LaunchedServer[] = []): string {
  if (servers.length === 0) return `(no servers started; run dir ${runDir})`;
  return servers
    .map((s) => `----- ${s.name} (${s.kind}, pid ${s.pid}) ${s.logPath}\n${tail(s.logPath)}`)
    .join('\n');
}

/** Kills and removes every deployment still open (afterEach / afterAll). */
export async function closeAll(): Promise<void> {
  await Promise.allSettled([...live].map((d) => d.close()));
}

/** Last resort when jest itself goes away: no process may outlive the test run. */
process.once('exit', () => {
  for (const d of live) d.killAll();
});

/**
 * A jest test whose failure prints the log tail of every server of every deployment it started,
 * then kills them.
 */
export function scenario(name: string, body: () => Promise<void>, timeoutMs?: number): void {
  it(
    name,
    async () => {
      try {
        await body();
      } catch (err) {
        for (const d of live)
          process.stderr.write(`\n===== logs of ${d.shape} (${name})\n${d.logTails()}\n`);
        // The failure summary ends a long run's output, where a truncated log still shows it.
        const warnings = [...live].map((d) => d.warnings()).join('\n');
        if (err instanceof Error && warnings !== '') {
          err.message += `\n\nwarnings and errors the servers logged:\n${warnings}`;
        }
        throw err;
      } finally {
        await closeAll();
      }
    },
    timeoutMs,
  );
}

export { captureKey };
