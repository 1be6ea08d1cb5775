import {
  COMMANDS,
  DEFAULT_CONCURRENCY,
  DEFAULT_DEADLINE_SECONDS,
  DEFAULT_DEMO_ROLLOUTS,
  DEFAULT_GRACE_SECONDS,
  type Invocation,
  parseCommandLine,
  type ParseOutcome,
} from '../src/args.js';

function invocation(argv: string[]): Invocation {
  const outcome = parseCommandLine(argv);
  if (outcome.kind !== 'invoke')
    throw new Error(`expected an invocation, got ${JSON.stringify(outcome)}`);
  return outcome.invocation;
}

function usageError(argv: string[]): Extract<ParseOutcome, { kind: 'usage-error' }> {
  const outcome = parseCommandLine(argv);
  if (outcome.kind !== 'usage-error')
    throw new Error(`expected a usage error, got ${outcome.kind}`);
  return outcome;
}

describe('parseCommandLine', () => {
  test('every option of checkpoint parses into the invocation', () => {
    expect(
      invocation([
        'checkpoint',
        '--config',
        'my.yaml',
        '--json',
        '--id',
        'ckpt-1',
        '--dir',
        'out/ckpt',
        '--deadline',
        '2.5',
        '--episodes',
        'r1, r2-a1,,r1',
        '--stop',
      ]),
    ).toEqual({
      command: 'checkpoint',
      config: 'my.yaml',
      json: true,
      id: 'ckpt-1',
      dir: 'out/ckpt',
      deadlineSeconds: 2.5,
      episodes: [
        { rollout_id: 'r1', attempt: 0 },
        { rollout_id: 'r2', attempt: 1 },
      ],
      rollouts: undefined,
      stop: true,
      restartMissing: false,
      server: undefined,
      detach: false,
      runDir: undefined,
      graceSeconds: DEFAULT_GRACE_SECONDS,
      all: false,
      input: undefined,
      output: undefined,
      concurrency: DEFAULT_CONCURRENCY,
      checkpointDir: undefined,
      resume: false,
      checkpointEverySeconds: undefined,
      format: undefined,
      limit: undefined,
      numRepeats: undefined,
      rolloutCount: DEFAULT_DEMO_ROLLOUTS,
      demoTools: 'direct_http',
      watch: false,
    });
  });

  test('run takes the collection options; checkpoint-now its directory', () => {
    expect(
      invocation([
        'run',
        '--input',
        'in.jsonl',
        '--output',
        'out.jsonl',
        '--checkpoint-every',
        '2.5',
        '--format',
        'nemo',
        '--limit',
        '5',
        '--num-repeats',
        '3',
        '--server',
        'legacy_env',
      ]),
    ).toMatchObject({
      checkpointEverySeconds: 2.5,
      format: 'nemo',
      limit: 5,
      numRepeats: 3,
      server: 'legacy_env',
    });
    expect(usageError(['run', '--input', 'i', '--output', 'o', '--format', 'csv']).message).toBe(
      '--format must be ckpt-gym or nemo, got "csv"',
    );
    expect(
      usageError(['run', '--input', 'i', '--output', 'o', '--checkpoint-every', '0']).message,
    ).toMatch(/--checkpoint-every must be a positive number of seconds/);
    expect(invocation(['checkpoint-now', '--checkpoint-dir', 'c', '--stop'])).toMatchObject({
      command: 'checkpoint-now',
      checkpointDir: 'c',
      stop: true,
    });
    expect(usageError(['checkpoint-now']).message).toBe('checkpoint-now needs --checkpoint-dir');
  });

  test('a rollout id longer than core takes is a usage error', () => {
    expect(invocation(['forget', '--rollouts', 'r'.repeat(219)]).rollouts).toHaveLength(1);
    expect(usageError(['forget', '--rollouts', 'r'.repeat(220)]).message).toBe(
      '--rollouts: rollout id of 220 characters is longer than 219',
    );
  });

  test('restore takes --restart-missing; no other command does', () => {
    expect(invocation(['restore', '--dir', 'd', '--restart-missing'])).toMatchObject({
      command: 'restore',
      restartMissing: true,
    });
    expect(invocation(['restore', '--dir', 'd'])).toMatchObject({ restartMissing: false });
    expect(parseCommandLine(['commit', '--dir', 'd', '--restart-missing']).kind).toBe(
      'usage-error',
    );
  });

  test('defaults: no config, human output, the default deadline', () => {
    expect(invocation(['status'])).toMatchObject({
      command: 'status',
      config: undefined,
      json: false,
      id: undefined,
      deadlineSeconds: DEFAULT_DEADLINE_SECONDS,
      stop: false,
    });
  });

  test('options may come before the command, and -c is --config', () => {
    expect(invocation(['-c', 'a.yaml', '--json', 'discover'])).toMatchObject({
      command: 'discover',
      config: 'a.yaml',
      json: true,
    });
  });

  test('forget takes --rollouts, each once', () => {
    expect(invocation(['forget', '--rollouts', 'a,b,a']).rollouts).toEqual(['a', 'b']);
  });

  test('a bad capture key is a usage error', () => {
    expect(usageError(['retire', '--episodes', 'ok,bad key']).message).toMatch(
      /--episodes: bad capture key "bad key"/,
    );
    expect(usageError(['retire', '--episodes=-a1']).message).toMatch(/bad capture key "-a1"/);
    expect(usageError(['retire', '--episodes', ' , ']).message).toMatch(/names no capture key/);
  });

  test('a bad rollout id is a usage error', () => {
    expect(usageError(['forget', '--rollouts', 'a/b']).message).toMatch(/bad rollout id "a\/b"/);
  });

  test('a bad checkpoint id is a usage error', () => {
    expect(usageError(['prepare', '--id', 'no spaces']).message).toMatch(
      /--id "no spaces" must match/,
    );
    expect(usageError(['prepare', '--id', 'x'.repeat(129)]).message).toMatch(/at most 128/);
  });

  test.each(['0', '-1', 'soon', 'Infinity', ''])('--deadline %j is a usage error', (value) => {
    expect(usageError(['prepare', `--deadline=${value}`]).message).toMatch(/--deadline/);
  });

  test('an unknown command is a usage error with the program usage', () => {
    const error = usageError(['frobnicate']);
    expect(error.message).toBe("unknown command 'frobnicate'");
    expect(error.usage).toMatch(/^usage: ckpt-gym <command>/);
  });

  test('no command is a usage error', () => {
    expect(usageError([]).message).toBe('no command given');
  });

  test('a missing option value is a usage error with the command usage', () => {
    const error = usageError(['prepare', '--deadline']);
    expect(error.message).toMatch(/--deadline <value>' argument missing/);
    expect(error.usage).toMatch(/^usage: ckpt-gym prepare/);
  });

  test('an unknown option is a usage error', () => {
    expect(usageError(['status', '--frob']).message).toBe("unknown option '--frob'");
    expect(usageError(['status', '-x']).message).toBe("unknown option '-x'");
  });

  test('a mistyped command or option says which one was meant', () => {
    expect(usageError(['stauts']).message).toBe(
      "unknown command 'stauts' (did you mean 'status'?)",
    );
    expect(usageError(['hlep']).message).toBe("unknown command 'hlep' (did you mean 'help'?)");
    expect(usageError(['status', '--confg', 'x.yaml']).message).toBe(
      "unknown option '--confg' (did you mean '--config'?)",
    );
    expect(usageError(['--confg=x.yaml', 'status']).message).toBe(
      "unknown option '--confg' (did you mean '--config'?)",
    );
    expect(usageError(['--jsno']).message).toBe("unknown option '--jsno' (did you mean '--json'?)");
  });

  test('an option is suggested among those the command takes', () => {
    // --dri is one edit from --dir, which commit takes and status does not.
    expect(usageError(['commit', '--dri', 'x']).message).toBe(
      "unknown option '--dri' (did you mean '--dir'?)",
    );
    expect(usageError(['status', '--dri', 'x']).message).toBe("unknown option '--dri'");
    expect(usageError(['--dri', 'x']).message).toBe(
      "unknown option '--dri' (did you mean '--dir'?)",
    );
  });

  test("node's other parse errors are in lower case too", () => {
    expect(usageError(['prepare', '--deadline']).message).toMatch(/^option '--deadline <value>'/);
  });

  test('--version and -V ask for the version, with or without --json or a command', () => {
    expect(parseCommandLine(['--version'])).toEqual({ kind: 'version', json: false });
    expect(parseCommandLine(['-V'])).toEqual({ kind: 'version', json: false });
    expect(parseCommandLine(['--version', '--json'])).toEqual({ kind: 'version', json: true });
    expect(parseCommandLine(['status', '-V'])).toEqual({ kind: 'version', json: false });
  });

  test('an option the command does not take is a usage error', () => {
    expect(usageError(['status', '--dir', 'x']).message).toBe('status takes no --dir');
    expect(usageError(['prepare', '--stop']).message).toBe('prepare takes no --stop');
  });

  test('a required option that is missing is a usage error', () => {
    expect(usageError(['commit']).message).toBe('commit needs --dir');
    expect(usageError(['retire']).message).toBe('retire needs --episodes');
    expect(usageError(['forget']).message).toBe('forget needs --rollouts or --episodes');
  });

  test('an extra argument is a usage error', () => {
    expect(usageError(['status', 'now']).message).toBe("unexpected argument 'now'");
  });

  test('the usage error remembers --json', () => {
    expect(usageError(['frob', '--json']).json).toBe(true);
    expect(usageError(['frob']).json).toBe(false);
  });

  test('--help, -h and help give the program or a command help', () => {
    expect(parseCommandLine(['--help'])).toEqual({
      kind: 'help',
      text: expect.stringMatching(/^usage: ckpt-gym <command>/),
    });
    expect(parseCommandLine(['help', 'commit'])).toEqual({
      kind: 'help',
      text: expect.stringMatching(
        /^usage: ckpt-gym commit \[--id ID\] \[--deadline SECONDS\] --dir DIR/,
      ),
    });
    expect(parseCommandLine(['retire', '-h'])).toEqual({
      kind: 'help',
      text: expect.stringMatching(/^usage: ckpt-gym retire/),
    });
  });

  test('the program help lists every command', () => {
    const outcome = parseCommandLine(['--help']);
    const text = outcome.kind === 'help' ? outcome.text : '';
    for (const name of Object.keys(COMMANDS)) expect(text).toMatch(new RegExp(`^  ${name} `, 'm'));
  });
});
