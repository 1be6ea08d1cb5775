/** Parsing of the stack commands (serve, up, down, crash, run, demo) and their exit codes. */
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { parseCommandLine } from '../src/args.js';
import { ExitCode } from '../src/index.js';
import { cli } from './support/cli.js';

function parsed(argv: string[]) {
  const outcome = parseCommandLine(argv);
  if (outcome.kind !== 'invoke')
    throw new Error(`expected an invocation: ${JSON.stringify(outcome)}`);
  return outcome.invocation;
}

function usage(argv: string[]): string {
  const outcome = parseCommandLine(argv);
  if (outcome.kind !== 'usage-error')
    throw new Error(`expected a usage error, got ${outcome.kind}`);
  return outcome.message;
}

describe('stack commands', () => {
  test('serve needs --server', () => {
    expect(usage(['serve'])).toBe('serve needs --server');
    expect(parsed(['serve', '--server', 'env']).server).toBe('env');
  });

  test('up takes --detach and --run-dir; down takes --grace; crash takes --all', () => {
    expect(parsed(['up', '--detach', '--run-dir', 'r'])).toMatchObject({
      detach: true,
      runDir: 'r',
    });
    expect(parsed(['down', '--grace', '0']).graceSeconds).toBe(0);
    expect(parsed(['crash', '--all']).all).toBe(true);
    expect(usage(['crash', '--detach'])).toBe('crash takes no --detach');
    expect(usage(['down', '--grace=-1'])).toMatch(/--grace must be a non-negative number/);
  });

  test('run needs --input and --output; --concurrency is a whole number ≥ 1', () => {
    expect(usage(['run', '--output', 'o'])).toBe('run needs --input');
    expect(usage(['run', '--input', 'i'])).toBe('run needs --output');
    expect(
      parsed([
        'run',
        '--input',
        'i',
        '--output',
        'o',
        '--concurrency',
        '3',
        '--resume',
        '--checkpoint-dir',
        'c',
      ]),
    ).toMatchObject({ input: 'i', output: 'o', concurrency: 3, resume: true, checkpointDir: 'c' });
    expect(usage(['run', '--input', 'i', '--output', 'o', '--concurrency', '0'])).toMatch(
      /--concurrency must be a whole number/,
    );
    expect(usage(['run', '--input', 'i', '--output', 'o', '--concurrency', '2.5'])).toMatch(
      /--concurrency must be a whole number/,
    );
  });

  test('demo --rollouts is a count, not a list of rollout ids', () => {
    expect(parsed(['demo']).rolloutCount).toBe(32);
    expect(parsed(['demo', '--rollouts', '4'])).toMatchObject({
      rolloutCount: 4,
      rollouts: undefined,
    });
    expect(usage(['demo', '--rollouts', 'r1,r2'])).toMatch(/--rollouts must be a whole number/);
  });

  test('a usage error of a stack command exits 2', async () => {
    const run = await cli(['run', '--input', 'x'], process.cwd());
    expect(run.code).toBe(ExitCode.USAGE);
    expect(run.stderr).toMatch(/run needs --output/);
  });

  test('run with an input file that is not there fails (exit 1) before it writes anything', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-run-args-'));
    try {
      const run = await cli(
        ['run', '--input', 'missing.jsonl', '--output', 'o.jsonl', '--json'],
        dir,
      );
      expect(run.code).toBe(ExitCode.FAILURE);
      expect(run.json()).toMatchObject({
        ok: false,
        error: { message: expect.stringMatching(/missing\.jsonl/) },
      });
      expect(existsSync(join(dir, 'o.jsonl.checkpoints'))).toBe(false);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
