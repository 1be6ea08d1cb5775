/**
 * Command-line parsing, pure: argv in, a typed invocation (or help text, or a usage error) out.
 * The command table below is the one place a command is declared; stack commands (`serve`, `up`,
 * `down`, `crash`, `run`, `demo`) slot in as further entries with their own options.
 */
import { parseArgs, type ParseArgsConfig } from 'node:util';

import {
  CHECKPOINT_ID_MAX_LENGTH,
  CHECKPOINT_ID_PATTERN,
  type EpisodeId,
  MAX_ROLLOUT_ID_LENGTH,
  parseCaptureKey,
  ROLLOUT_ID_PATTERN,
} from '@ckpt-gym/core/protocol';

import { closest, didYouMean } from '@ckpt-gym/core/server';

export const PROGRAM = 'ckpt-gym';
export const DEFAULT_CONFIG_FILE = 'ckpt-gym.yaml';
export const DEFAULT_DEADLINE_SECONDS = 30;
/** Where `up` writes its run file and logs, and where `down` and `crash` read them. */
export const DEFAULT_RUN_DIR = '.ckpt-gym/run';
export const DEFAULT_GRACE_SECONDS = 10;
export const DEFAULT_CONCURRENCY = 16;
export const DEFAULT_DEMO_ROLLOUTS = 32;
export const INPUT_FORMATS = ['ckpt-gym', 'nemo'] as const;
export type InputFormatOption = (typeof INPUT_FORMATS)[number];

/** Options a command may take, besides the global `--config`, `--json` and `--help`. */
export type OptionName =
  | 'id'
  | 'dir'
  | 'deadline'
  | 'episodes'
  | 'rollouts'
  | 'stop'
  | 'restart-missing'
  | 'server'
  | 'detach'
  | 'run-dir'
  | 'grace'
  | 'all'
  | 'input'
  | 'output'
  | 'concurrency'
  | 'checkpoint-dir'
  | 'resume'
  | 'checkpoint-every'
  | 'format'
  | 'limit'
  | 'num-repeats'
  | 'tools'
  | 'watch';

interface OptionSpec {
  readonly type: 'string' | 'boolean';
  readonly value?: string;
  readonly help: string;
}

/** `demo --tools`: how the demo's agents take their tools. */
export const DEMO_TOOL_TRANSPORTS = ['direct_http', 'mcp'] as const;
export type DemoToolTransport = (typeof DEMO_TOOL_TRANSPORTS)[number];

const OPTIONS: Readonly<Record<OptionName, OptionSpec>> = {
  id: { type: 'string', value: 'ID', help: 'checkpoint id (see each command for its default)' },
  dir: {
    type: 'string',
    value: 'DIR',
    help: 'checkpoint directory (relative to the working directory)',
  },
  deadline: {
    type: 'string',
    value: 'SECONDS',
    help: `seconds from now the participants get for the work (default ${DEFAULT_DEADLINE_SECONDS})`,
  },
  episodes: {
    type: 'string',
    value: 'KEYS',
    help: 'comma-separated capture keys: r for attempt 0, r-aN for attempt N',
  },
  rollouts: {
    type: 'string',
    value: 'IDS|N',
    help: `comma-separated rollout ids (demo: how many rollouts, default ${DEFAULT_DEMO_ROLLOUTS})`,
  },
  stop: {
    type: 'boolean',
    help:
      'commit with stop: free exported state outside the processes; the stack stays closed ' +
      '(checkpoint-now: the collection does so and exits 75)',
  },
  'restart-missing': {
    type: 'boolean',
    help: 'restore: start over (reported as restarts) the scope episodes not held where they must be, instead of refusing',
  },
  server: {
    type: 'string',
    value: 'NAME',
    help: 'the server of the stack file to run (run: the environment server to collect through)',
  },
  detach: { type: 'boolean', help: 'start the stack and exit, leaving it running' },
  'run-dir': {
    type: 'string',
    value: 'DIR',
    help: `run file, resolved stack file and logs (default ./${DEFAULT_RUN_DIR})`,
  },
  grace: {
    type: 'string',
    value: 'SECONDS',
    help: `time from SIGTERM to SIGKILL (default ${DEFAULT_GRACE_SECONDS})`,
  },
  all: { type: 'boolean', help: 'the inference backend too' },
  input: { type: 'string', value: 'FILE', help: 'tasks, one JSON object a line' },
  output: { type: 'string', value: 'FILE', help: 'results, one JSON object a line (appended)' },
  concurrency: {
    type: 'string',
    value: 'N',
    help: `episodes in flight at once (default ${DEFAULT_CONCURRENCY})`,
  },
  'checkpoint-dir': {
    type: 'string',
    value: 'DIR',
    help: "the collection's directory: dispatch log, pid, checkpoints, LATEST (default <output>.checkpoints)",
  },
  resume: {
    type: 'boolean',
    help: 'finish the run --output and --checkpoint-dir name, from its latest checkpoint',
  },
  'checkpoint-every': {
    type: 'string',
    value: 'SECONDS',
    help: 'also take a checkpoint every SECONDS while rollouts are in flight',
  },
  format: {
    type: 'string',
    value: 'FORMAT',
    help: `input and output rows: ${INPUT_FORMATS.join(' or ')} (default: nemo when the first row is a NeMo Gym row)`,
  },
  limit: { type: 'string', value: 'N', help: 'collect only the first N input rows' },
  'num-repeats': {
    type: 'string',
    value: 'N',
    help: 'NeMo Gym rows: run each row N times (_ng_rollout_index 0…N-1)',
  },
  watch: {
    type: 'boolean',
    help: 'refresh every second until Ctrl-C (one line a refresh when stdout is not a terminal)',
  },
  tools: {
    type: 'string',
    value: 'TRANSPORT',
    help: `how the agents take their tools: ${DEMO_TOOL_TRANSPORTS.join(' or ')} (default direct_http)`,
  },
};

const GLOBAL_HELP: readonly [string, string][] = [
  [
    '--config FILE',
    `stack file (default ./${DEFAULT_CONFIG_FILE}, else the bundled local example)`,
  ],
  ['--json', 'print one JSON document on stdout instead of human-readable output'],
  ['--help, -h', 'show help'],
  ['--version, -V', 'print the version of ckpt-gym'],
];

export interface CommandSpec {
  readonly summary: string;
  readonly options: readonly OptionName[];
  /** Options the command cannot run without; an inner array means "one of these". */
  readonly required: readonly (OptionName | readonly OptionName[])[];
  /** What the help says beyond the option list. */
  readonly details: string;
}

const TIMING: readonly OptionName[] = ['id', 'deadline'];

export const COMMANDS = {
  status: {
    summary: 'every participant: kind, phase, checkpoint id, lease, retired rollouts, readiness',
    options: ['deadline', 'watch'],
    required: [],
    details:
      'Asks every gym server of the stack (inference backends excepted) for its status, and\n' +
      'lists the workers of a server that runs several. --watch: a live view (phase, in flight,\n' +
      "held, waiting, workers, the last checkpoint's stage durations) refreshed every second;\n" +
      'when stdout is not a terminal, one text line a refresh (--json: one JSON object a line).\n' +
      'Ctrl-C ends it with exit 0.',
  },
  discover: {
    summary: 'find the participants and their kinds',
    options: ['deadline'],
    required: [],
    details: 'Fails when a server is down, never replies, or no policy model takes part.',
  },
  prepare: {
    summary: 'close admission and wait until every participant is at a boundary',
    options: TIMING,
    required: [],
    details:
      'Stages: environment, model, agent, resources; stops at the first stage not prepared.\n' +
      '--id defaults to a new ckpt-<UTC time> id. Exit 3 when the deadline passed first:\n' +
      'admission stays closed until you resume.',
  },
  commit: {
    summary: 'write every participant’s records for the continued episodes into --dir',
    options: [...TIMING, 'dir', 'episodes', 'stop'],
    required: ['dir'],
    details:
      '--id defaults to the checkpoint open on the participants. Without --episodes the scope is\n' +
      'every episode the environment servers hold (live and unclaimed restored), minus restarts.\n' +
      'Then publishes <dir>/controller.json, which restore reads.',
  },
  restore: {
    summary: 'install a checkpoint into fresh processes, all or nothing',
    options: [...TIMING, 'dir', 'episodes', 'restart-missing'],
    required: ['dir'],
    details:
      '--id defaults to a new restore-<UTC time> id; --episodes defaults to the scope in\n' +
      '<dir>/controller.json. Every manifest must name the checkpoint controller.json names and\n' +
      'every episode in scope must be held where it was committed, else nothing is sent. If a\n' +
      'participant still fails, the replacement attempts are retired where it succeeded and all\n' +
      'resume.',
  },
  resume: {
    summary: 'reopen admission, in reverse prepare order',
    options: TIMING,
    required: [],
    details: '--id defaults to the checkpoint open on the participants (none open: nothing to do).',
  },
  retire: {
    summary: 'stop attempts everywhere and refuse them until forget (callers first)',
    options: [...TIMING, 'episodes'],
    required: ['episodes'],
    details: '--id defaults to the open (restored) checkpoint, else a new retire-<UTC time> id.',
  },
  forget: {
    summary: 'end the retired marks of rollouts done for good',
    options: [...TIMING, 'rollouts', 'episodes'],
    required: [['rollouts', 'episodes']],
    details: '--episodes names the rollouts of those keys. --id defaults as for retire.',
  },
  renew: {
    summary: 'extend every participant’s lease on the open checkpoint',
    options: TIMING,
    required: [],
    details: '--id defaults to the checkpoint open on the participants.',
  },
  checkpoint: {
    summary: 'prepare, commit every episode in flight, resume; with times per stage',
    options: [...TIMING, 'dir', 'episodes', 'stop'],
    required: ['dir'],
    details:
      'Each stage gets --deadline seconds from its start. Not prepared in time: prints the\n' +
      'blockers, resumes, exits 3. With --stop it does not resume: stop the stack now (the\n' +
      'participants reopen on their own when the lease expires).',
  },
  serve: {
    summary: 'run one server of the stack file in the foreground (SIGTERM drains and exits)',
    options: ['server'],
    required: ['server'],
    details:
      'What `up` and the containers run. Prints one JSON line {"event":"listening",…} on stdout.',
  },
  up: {
    summary: 'start every server, each its own process group, in dependency order',
    options: ['detach', 'run-dir'],
    required: [],
    details:
      'Order: inference, resources, model, agent, environment; waits for each health route.\n' +
      'Servers with port 0 get a free port; every process runs from <run-dir>/stack.yaml (use\n' +
      'it as --config of the other commands). Without --detach, Ctrl-C stops everything.',
  },
  down: {
    summary: 'stop the servers `up` started: SIGTERM, then SIGKILL after --grace',
    options: ['run-dir', 'grace'],
    required: [],
    details: 'Reads <run-dir>/run.json; removes it once every process is gone.',
  },
  crash: {
    summary: 'SIGKILL every gym process group (the inference backend survives unless --all)',
    options: ['run-dir', 'all'],
    required: [],
    details: 'Reads <run-dir>/run.json. Start fresh processes with `up` again.',
  },
  run: {
    summary: 'collect rollouts: dispatch tasks to the environment server, write the results',
    options: [
      'input',
      'output',
      'concurrency',
      'checkpoint-dir',
      'resume',
      'checkpoint-every',
      'format',
      'limit',
      'num-repeats',
      'server',
      'deadline',
    ],
    required: ['input', 'output'],
    details:
      'Every rollout id is <run id>.<task key>; the run id is in every output row. The\n' +
      'collector writes its pid to <checkpoint-dir>/collector.pid. SIGUSR1 (or checkpoint-now)\n' +
      'takes a checkpoint and goes on; SIGTERM (or checkpoint-now --stop) takes one and exits\n' +
      '75. --resume finishes the same run: it restores the checkpoint LATEST names if the\n' +
      'previous run published it, continues its rows as their next attempt, retires every\n' +
      'other row the previous run sent and starts it over, and skips rows with an outcome.\n' +
      '--server picks the environment server (default: the first of the stack file).',
  },
  'checkpoint-now': {
    summary: 'ask a running collection (`run`) for a checkpoint, however it was started',
    options: ['checkpoint-dir', 'stop', 'deadline'],
    required: ['checkpoint-dir'],
    details:
      'Signals the pid in <checkpoint-dir>/collector.pid (SIGUSR1; --stop: SIGTERM), then waits\n' +
      'up to --deadline seconds for LATEST to name a new checkpoint. Works under node, npx\n' +
      'and npm alike: the signal goes to the collector, not to a wrapper.',
  },
  demo: {
    summary: 'crash and restore a local stack with rollouts in flight; every rollout finishes once',
    options: ['rollouts', 'run-dir', 'tools'],
    required: [],
    details:
      'Starts fake inference, a policy model, weather and counter resources, a Simple Agent\n' +
      'and a single_agent_turn environment for each, in a temporary directory (or --run-dir),\n' +
      'dispatches the rollouts (half weather, half counter), checkpoints them mid-flight,\n' +
      'SIGKILLs every gym process, restores into fresh ones and finishes. Exit 0 only if\n' +
      'every rollout finished once with reward 1 and no delivered\n' +
      'model call of a continued rollout was repeated. --tools mcp: the agents take their\n' +
      'tools over MCP, so every rollout in flight at the crash starts over.',
  },
} as const satisfies Record<string, CommandSpec>;

export type CommandName = keyof typeof COMMANDS;

export function isCommandName(name: string): name is CommandName {
  return Object.hasOwn(COMMANDS, name);
}

/** A parsed command line, ready to run. */
export interface Invocation {
  readonly command: CommandName;
  /** As given; undefined means the default lookup. */
  readonly config: string | undefined;
  readonly json: boolean;
  readonly id: string | undefined;
  readonly dir: string | undefined;
  readonly deadlineSeconds: number;
  readonly episodes: readonly EpisodeId[] | undefined;
  readonly rollouts: readonly string[] | undefined;
  readonly stop: boolean;
  /** `restore --restart-missing`. */
  readonly restartMissing: boolean;
  readonly server: string | undefined;
  readonly detach: boolean;
  /** As given; undefined means the default. */
  readonly runDir: string | undefined;
  readonly graceSeconds: number;
  readonly all: boolean;
  readonly input: string | undefined;
  readonly output: string | undefined;
  readonly concurrency: number;
  readonly checkpointDir: string | undefined;
  readonly resume: boolean;
  /** `run --checkpoint-every`. */
  readonly checkpointEverySeconds: number | undefined;
  /** `run --format`; undefined: detected from the input. */
  readonly format: InputFormatOption | undefined;
  readonly limit: number | undefined;
  readonly numRepeats: number | undefined;
  /** `demo --rollouts N`. */
  readonly rolloutCount: number;
  /** `demo --tools`. */
  readonly demoTools: DemoToolTransport;
  /** `status --watch`. */
  readonly watch: boolean;
}

export type ParseOutcome =
  | { readonly kind: 'invoke'; readonly invocation: Invocation }
  | { readonly kind: 'help'; readonly text: string }
  | { readonly kind: 'version'; readonly json: boolean }
  | {
      readonly kind: 'usage-error';
      readonly message: string;
      readonly usage: string;
      /** Whether `--json` appeared, so the error can also be a JSON document. */
      readonly json: boolean;
    };

/** Thrown inside parsing only; becomes a usage-error outcome. */
class UsageError extends Error {}

const PARSE_OPTIONS: NonNullable<ParseArgsConfig['options']> = {
  config: { type: 'string', short: 'c' },
  json: { type: 'boolean' },
  help: { type: 'boolean', short: 'h' },
  version: { type: 'boolean', short: 'V' },
  ...Object.fromEntries(
    Object.entries(OPTIONS).map(([name, spec]) => [name, { type: spec.type }] as const),
  ),
};

type ParsedValues = Record<string, string | boolean | undefined>;

export function parseCommandLine(argv: readonly string[]): ParseOutcome {
  const json = argv.includes('--json');
  let values: ParsedValues;
  let positionals: string[];
  try {
    ({ values, positionals } = parseArgs({
      args: [...argv],
      options: PARSE_OPTIONS,
      strict: true,
      allowPositionals: true,
    }) as { values: ParsedValues; positionals: string[] });
  } catch (err) {
    // Positionals are unknown when parsing failed; the first command name seen picks the usage.
    const command = argv.find(isCommandName);
    return usageError(parseErrorMessage(err, argv, command), command, json);
  }

  if (values.version) return { kind: 'version', json: values.json === true };
  const [name, ...extra] = positionals;
  if (name === undefined) {
    return values.help
      ? { kind: 'help', text: programHelp() }
      : usageError('no command given', undefined, json);
  }
  if (name === 'help') {
    const topic = extra[0];
    if (topic !== undefined && isCommandName(topic))
      return { kind: 'help', text: commandHelp(topic) };
    return { kind: 'help', text: programHelp() };
  }
  if (!isCommandName(name)) {
    const suggestion = closest(name, [...Object.keys(COMMANDS), 'help']);
    return usageError(`unknown command '${name}'${didYouMean(suggestion)}`, undefined, json);
  }
  if (values.help) return { kind: 'help', text: commandHelp(name) };
  try {
    if (extra.length > 0) throw new UsageError(`unexpected argument '${extra[0]}'`);
    return { kind: 'invoke', invocation: buildInvocation(name, values) };
  } catch (err) {
    if (err instanceof UsageError) return usageError(err.message, name, json);
    throw err;
  }
}

function usageError(
  message: string,
  command: CommandName | undefined,
  json: boolean,
): ParseOutcome {
  return {
    kind: 'usage-error',
    message,
    usage: command === undefined ? programHelp() : commandHelp(command),
    json,
  };
}

/**
 * node's parseArgs messages in lower case, minus its advice about `--` that does not fit this CLI;
 * an unknown option with the nearest known one.
 */
function parseErrorMessage(
  err: unknown,
  argv: readonly string[],
  command: CommandName | undefined,
): string {
  // Not `instanceof Error`: node's own errors may come from another realm (a test's vm context).
  const { code, message: raw } = (err ?? {}) as { code?: unknown; message?: unknown };
  const unknown = code === 'ERR_PARSE_ARGS_UNKNOWN_OPTION' ? unknownOption(argv) : undefined;
  if (unknown !== undefined) return unknownOptionMessage(unknown, command);
  const message = typeof raw === 'string' ? raw : String(err);
  const first = message.split('. To specify a positional argument')[0] ?? message;
  return first.charAt(0).toLowerCase() + first.slice(1);
}

/** The first option of `argv` the parser does not know, as written (`--confg`, `-x`). */
function unknownOption(argv: readonly string[]): string | undefined {
  const { tokens } = parseArgs({
    args: [...argv],
    options: PARSE_OPTIONS,
    strict: false,
    allowPositionals: true,
    tokens: true,
  });
  for (const token of tokens) {
    if (token.kind === 'option' && !Object.hasOwn(PARSE_OPTIONS, token.name)) return token.rawName;
  }
  return undefined;
}

/** Suggests among the command's own options and the global ones (every option without a command). */
function unknownOptionMessage(option: string, command: CommandName | undefined): string {
  const commandOptions: readonly string[] =
    command === undefined ? Object.keys(OPTIONS) : COMMANDS[command].options;
  const global = Object.keys(PARSE_OPTIONS).filter((name) => !Object.hasOwn(OPTIONS, name));
  const known = [...commandOptions, ...global];
  const suggestion = option.startsWith('--') ? closest(option.slice(2), known) : undefined;
  return `unknown option '${option}'${didYouMean(suggestion && `--${suggestion}`)}`;
}

function buildInvocation(command: CommandName, values: ParsedValues): Invocation {
  const spec: CommandSpec = COMMANDS[command];
  for (const name of Object.keys(OPTIONS) as OptionName[]) {
    if (values[name] !== undefined && !spec.options.includes(name)) {
      throw new UsageError(`${command} takes no --${name}`);
    }
  }
  for (const need of spec.required) {
    const oneOf: readonly OptionName[] = typeof need === 'string' ? [need] : need;
    if (oneOf.every((name) => values[name] === undefined)) {
      throw new UsageError(`${command} needs ${oneOf.map((name) => `--${name}`).join(' or ')}`);
    }
  }
  const text = (name: string): string | undefined => {
    const value = values[name];
    if (typeof value === 'string' && value.trim() === '')
      throw new UsageError(`--${name} is empty`);
    return typeof value === 'string' ? value : undefined;
  };
  const id = text('id');
  const deadline = text('deadline');
  const episodes = text('episodes');
  const rollouts = text('rollouts');
  const grace = text('grace');
  const concurrency = text('concurrency');
  const every = text('checkpoint-every');
  const format = text('format');
  const limit = text('limit');
  const repeats = text('num-repeats');
  const tools = text('tools');
  const demo = command === 'demo';
  return {
    command,
    config: text('config'),
    json: values.json === true,
    id: id === undefined ? undefined : parseCheckpointId(id),
    dir: text('dir'),
    deadlineSeconds: deadline === undefined ? DEFAULT_DEADLINE_SECONDS : parseDeadline(deadline),
    episodes: episodes === undefined ? undefined : parseEpisodes(episodes),
    rollouts: rollouts === undefined || demo ? undefined : parseRollouts(rollouts),
    stop: values.stop === true,
    restartMissing: values['restart-missing'] === true,
    server: text('server'),
    detach: values.detach === true,
    runDir: text('run-dir'),
    graceSeconds: grace === undefined ? DEFAULT_GRACE_SECONDS : parseSeconds('grace', grace, true),
    all: values.all === true,
    input: text('input'),
    output: text('output'),
    concurrency:
      concurrency === undefined ? DEFAULT_CONCURRENCY : parseCount('concurrency', concurrency),
    checkpointDir: text('checkpoint-dir'),
    resume: values.resume === true,
    checkpointEverySeconds:
      every === undefined ? undefined : parseSeconds('checkpoint-every', every),
    format: format === undefined ? undefined : parseChoice('format', INPUT_FORMATS, format),
    limit: limit === undefined ? undefined : parseCount('limit', limit),
    numRepeats: repeats === undefined ? undefined : parseCount('num-repeats', repeats),
    rolloutCount:
      demo && rollouts !== undefined ? parseCount('rollouts', rollouts) : DEFAULT_DEMO_ROLLOUTS,
    demoTools:
      tools === undefined ? 'direct_http' : parseChoice('tools', DEMO_TOOL_TRANSPORTS, tools),
    watch: values.watch === true,
  };
}

export function parseCheckpointId(id: string): string {
  if (!CHECKPOINT_ID_PATTERN.test(id) || id.length > CHECKPOINT_ID_MAX_LENGTH) {
    throw new UsageError(
      `--id ${JSON.stringify(id)} must match ${CHECKPOINT_ID_PATTERN.source} ` +
        `(at most ${CHECKPOINT_ID_MAX_LENGTH} characters)`,
    );
  }
  return id;
}

/** Relative seconds: a positive, finite number. */
export function parseDeadline(text: string): number {
  return parseSeconds('deadline', text);
}

/** Seconds: finite and positive (or zero, when `zeroOk`). */
function parseSeconds(name: string, text: string, zeroOk = false): number {
  const seconds = Number(text);
  if (!Number.isFinite(seconds) || seconds < 0 || (seconds === 0 && !zeroOk)) {
    throw new UsageError(
      `--${name} must be a ${zeroOk ? 'non-negative' : 'positive'} number of seconds, ` +
        `got ${JSON.stringify(text)}`,
    );
  }
  return seconds;
}

/** `text` as one of an option's `choices`; anything else is a usage error naming them. */
function parseChoice<T extends string>(option: string, choices: readonly T[], text: string): T {
  const choice = choices.find((name) => name === text);
  if (choice === undefined) {
    throw new UsageError(
      `--${option} must be ${choices.join(' or ')}, got ${JSON.stringify(text)}`,
    );
  }
  return choice;
}

/** A whole number from 1 to 100000. */
export function parseCount(name: string, text: string): number {
  const n = Number(text);
  if (!/^\d+$/.test(text.trim()) || n < 1 || n > 100_000) {
    throw new UsageError(
      `--${name} must be a whole number from 1 to 100000, got ${JSON.stringify(text)}`,
    );
  }
  return n;
}

function splitList(text: string): string[] {
  return text
    .split(',')
    .map((item) => item.trim())
    .filter((item) => item !== '');
}

/** Capture keys, each once, in the order given. */
export function parseEpisodes(text: string): EpisodeId[] {
  const keys = [...new Set(splitList(text))];
  if (keys.length === 0) throw new UsageError('--episodes names no capture key');
  return keys.map((key) => {
    try {
      return parseCaptureKey(key);
    } catch (err) {
      throw new UsageError(
        `--episodes: bad capture key ${JSON.stringify(key)}: ${(err as Error).message}`,
      );
    }
  });
}

/** Rollout ids, each once, in the order given. */
export function parseRollouts(text: string): string[] {
  const ids = [...new Set(splitList(text))];
  if (ids.length === 0) throw new UsageError('--rollouts names no rollout id');
  for (const id of ids) {
    if (!ROLLOUT_ID_PATTERN.test(id)) {
      throw new UsageError(
        `--rollouts: bad rollout id ${JSON.stringify(id)}: must match ${ROLLOUT_ID_PATTERN.source}`,
      );
    }
    if (id.length > MAX_ROLLOUT_ID_LENGTH) {
      throw new UsageError(
        `--rollouts: rollout id of ${id.length} characters is longer than ${MAX_ROLLOUT_ID_LENGTH}`,
      );
    }
  }
  return ids;
}

// ---------------------------------------------------------------------------------------------
// Help.

function columns(rows: readonly [string, string][], indent = '  '): string {
  const width = Math.max(...rows.map(([left]) => left.length));
  return rows.map(([left, right]) => `${indent}${left.padEnd(width)}  ${right}`).join('\n');
}

export function programHelp(): string {
  const commands = Object.entries(COMMANDS).map(
    ([name, spec]) => [name, spec.summary] as [string, string],
  );
  return [
    `usage: ${PROGRAM} <command> [options]`,
    '',
    'Runs a ckpt-gym stack, drives its checkpoints, collects rollouts.',
    '',
    'commands:',
    columns(commands),
    '',
    'global options:',
    columns(GLOBAL_HELP),
    '',
    `Run '${PROGRAM} <command> --help' for a command's options.`,
    'Exit codes: 0 success, 1 failure, 2 usage error, 3 prepare missed its deadline,',
    '75 a collection stopped after a checkpoint.',
  ].join('\n');
}

function optionLabel(name: OptionName): string {
  const spec = OPTIONS[name];
  return spec.value === undefined ? `--${name}` : `--${name} ${spec.value}`;
}

export function commandHelp(command: CommandName): string {
  const spec: CommandSpec = COMMANDS[command];
  const required = new Set(
    spec.required.filter((need): need is OptionName => typeof need === 'string'),
  );
  const synopsis = spec.options.map((name) =>
    required.has(name) ? optionLabel(name) : `[${optionLabel(name)}]`,
  );
  const options = spec.options.map(
    (name) => [optionLabel(name), OPTIONS[name].help] as [string, string],
  );
  return [
    `usage: ${PROGRAM} ${command} ${synopsis.join(' ')}`.trimEnd(),
    '',
    `${spec.summary}.`,
    spec.details,
    '',
    ...(options.length > 0 ? ['options:', columns(options), ''] : []),
    'global options:',
    columns(GLOBAL_HELP),
  ].join('\n');
}
