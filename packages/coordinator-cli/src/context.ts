/**
 * What every command runs with: the io it writes to, the loaded stack file, the control bearer,
 * HTTP clients on the reserved control pool, and the participants (discovered once, on demand).
 */
import { existsSync } from 'node:fs';
import { resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import {
  CoordinationError,
  type CoordinationLogger,
  createHttpClients,
  discover,
  DISCOVER_TIMEOUT_SECONDS,
  getControl,
  type HttpClients,
  type Participants,
  replyTimeoutMs,
  CHECKPOINT_ROUTE_PREFIX,
} from '@ckpt-gym/core/client';
import { controlPoolLimits, type StackSettings } from '@ckpt-gym/core/server';

import { DEFAULT_CONFIG_FILE, type Invocation } from './args.js';
import { ExitCode, type ExitCodeValue } from './exit-codes.js';
import { loadStack } from './stack-file.js';

/**
 * The example stack shipped with the repository, resolved through the repo layout (this module
 * sits in `src/` or `dist/` of packages/coordinator-cli, so the path is the same from both).
 */
export const BUNDLED_EXAMPLE = fileURLToPath(
  new URL('../../../examples/local.yaml', import.meta.url),
);

export interface Sink {
  write(chunk: string): unknown;
}

export interface CliIo {
  readonly stdout: Sink;
  readonly stderr: Sink;
  /** Read for `${VAR}` interpolation in the stack file. */
  readonly env: Readonly<Record<string, string | undefined>>;
  /** Relative `--config` and `--dir` paths resolve against it. */
  readonly cwd: string;
}

/** A command that could not do its work; `failures` names the participants that failed. */
export class CliFailure extends Error {
  constructor(
    message: string,
    readonly failures: Readonly<Record<string, string>> = {},
    readonly exitCode: ExitCodeValue = ExitCode.FAILURE,
    /** Extra JSON details (what was done before the failure). */
    readonly data: Readonly<Record<string, unknown>> = {},
  ) {
    super(message);
    this.name = 'CliFailure';
  }
}

/** `--config` as given, else `./ckpt-gym.yaml` when it exists, else the bundled example. */
export function resolveConfigPath(
  given: string | undefined,
  cwd: string,
  exists: (path: string) => boolean = existsSync,
): string {
  if (given !== undefined) return resolve(cwd, given);
  const local = resolve(cwd, DEFAULT_CONFIG_FILE);
  return exists(local) ? local : BUNDLED_EXAMPLE;
}

/** Status replies by server name. */
export type StatusReplies = Record<string, Record<string, unknown>>;

/** Commands that only drive checkpoints, and so need checkpointing on. */
export const CHECKPOINT_COMMANDS: ReadonlySet<string> = new Set([
  'status',
  'discover',
  'prepare',
  'commit',
  'restore',
  'resume',
  'retire',
  'forget',
  'renew',
  'checkpoint',
]);

export class CommandContext {
  readonly stack: StackSettings;
  readonly configPath: string;
  readonly clients: HttpClients;
  readonly logger: CoordinationLogger;
  #participants: Promise<Participants> | undefined;

  constructor(
    readonly invocation: Invocation,
    readonly io: CliIo,
  ) {
    this.configPath = resolveConfigPath(invocation.config, io.cwd);
    this.stack = loadStack(this.configPath, io.env);
    // The checkpoint commands fail up front; the stack commands run any stack.
    if (CHECKPOINT_COMMANDS.has(invocation.command)) void this.token;
    this.clients = createHttpClients({ control: controlPoolLimits(this.stack) });
    // Coordination's swallowed cleanup errors go to stderr: stdout holds the command's output.
    this.logger = {
      warn: (message, meta) =>
        io.stderr.write(`warning: ${message}${meta ? ` ${JSON.stringify(meta)}` : ''}\n`),
    };
  }

  close(): void {
    this.clients.close();
  }

  /** The control bearer; a stack with checkpointing off cannot be driven. */
  get token(): string {
    if (!this.stack.checkpoint) {
      throw new CliFailure(
        `${this.configPath}: checkpointing is off (checkpoint.enabled is not true); ` +
          `'${this.invocation.command}' drives checkpoints and needs it on`,
      );
    }
    return this.stack.checkpoint.controlAuthToken;
  }

  nowSeconds(): number {
    return Date.now() / 1000;
  }

  /** The deadline of work starting now: `--deadline` seconds from now, as epoch seconds. */
  deadlineTs(): number {
    return this.nowSeconds() + this.invocation.deadlineSeconds;
  }

  /** One progress line on stderr, so stdout stays the command's output (or its JSON). */
  progress(line: string): void {
    this.io.stderr.write(`${line}\n`);
  }

  /** `--dir`, absolute: the participants resolve it in their own working directories otherwise. */
  checkpointDir(): string {
    const dir = this.invocation.dir;
    if (dir === undefined) throw new CliFailure(`${this.invocation.command} needs --dir`);
    return resolve(this.io.cwd, dir);
  }

  /** Probes are bounded by the command's deadline (and never beyond discover's own bound). */
  probeTimeoutSeconds(): number {
    return Math.min(this.invocation.deadlineSeconds, DISCOVER_TIMEOUT_SECONDS);
  }

  participants(): Promise<Participants> {
    this.#participants ??= discover(this.stack, {
      token: this.token,
      clients: this.clients,
      probeTimeoutSeconds: this.probeTimeoutSeconds(),
      logger: this.logger,
    });
    return this.#participants;
  }

  /** Every participant's status; any failure fails the whole call, naming each failing server. */
  async statuses(participants: Participants): Promise<StatusReplies> {
    const timeoutMs = replyTimeoutMs(this.nowSeconds() + this.probeTimeoutSeconds());
    const settled = await Promise.allSettled(
      participants.members.map((member) =>
        getControl(this.clients.control, statusUrl(member.url), { token: this.token, timeoutMs }),
      ),
    );
    const replies: StatusReplies = {};
    const failures: Record<string, string> = {};
    settled.forEach((outcome, index) => {
      const server = participants.members[index]?.server ?? String(index);
      if (outcome.status === 'fulfilled') replies[server] = outcome.value;
      else failures[server] = describe(outcome.reason);
    });
    if (Object.keys(failures).length > 0) throw new CoordinationError('status', failures);
    return replies;
  }
}

export function statusUrl(baseUrl: string): string {
  return `${baseUrl.replace(/\/+$/, '')}${CHECKPOINT_ROUTE_PREFIX}/status`;
}

/** An error's message; duck-typed, since node's own errors may come from another realm. */
export function describe(err: unknown): string {
  const message = (err as { message?: unknown } | null)?.message;
  return typeof message === 'string' && message !== '' ? message : String(err);
}

/** A checkpoint id for new work: `<prefix>-<UTC time to the millisecond>`. */
export function generatedId(prefix: string, now: Date = new Date()): string {
  const stamp = now.toISOString().replace(/[-:]/g, '').replace('.', '-');
  return `${prefix}-${stamp}`;
}
