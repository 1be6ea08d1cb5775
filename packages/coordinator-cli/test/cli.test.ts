/** runCli's frame: help, usage errors and the bundled example, in-process. */
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { BUNDLED_EXAMPLE, ExitCode, runCli } from '../src/index.js';

async function run(argv: string[], cwd = tmpdir()) {
  const out = { stdout: '', stderr: '' };
  const code = await runCli(argv, {
    stdout: { write: (chunk: string) => (out.stdout += chunk) },
    stderr: { write: (chunk: string) => (out.stderr += chunk) },
    env: {},
    cwd,
  });
  return { code, ...out };
}

describe('runCli', () => {
  test('--help prints the usage on stdout and exits 0', async () => {
    const result = await run(['--help']);
    expect(result.code).toBe(ExitCode.OK);
    expect(result.stdout).toMatch(/^usage: ckpt-gym <command>/);
    expect(result.stderr).toBe('');
  });

  test('--version and -V print the package version on stdout and exit 0', async () => {
    const { version } = JSON.parse(
      readFileSync(new URL('../package.json', import.meta.url), 'utf8'),
    ) as { version: string };
    for (const flag of ['--version', '-V']) {
      expect(await run([flag])).toEqual({ code: ExitCode.OK, stdout: `${version}\n`, stderr: '' });
    }
    const json = await run(['--version', '--json']);
    expect(json.code).toBe(ExitCode.OK);
    expect(JSON.parse(json.stdout)).toEqual({
      command: 'version',
      ok: true,
      exit_code: 0,
      version,
    });
  });

  test('an unknown command exits 2 with the usage on stderr and nothing on stdout', async () => {
    const result = await run(['frobnicate']);
    expect(result.code).toBe(ExitCode.USAGE);
    expect(result.stdout).toBe('');
    expect(result.stderr).toMatch(
      /^ckpt-gym: unknown command 'frobnicate'\n\nusage: ckpt-gym <command>/,
    );
  });

  test('a missing value exits 2 with the command usage on stderr', async () => {
    const result = await run(['commit', '--dir']);
    expect(result.code).toBe(ExitCode.USAGE);
    expect(result.stderr).toMatch(/argument missing\n\nusage: ckpt-gym commit/);
  });

  test('a usage error with --json is also one JSON document on stdout', async () => {
    const result = await run(['retire', '--episodes', 'bad key', '--json']);
    expect(result.code).toBe(ExitCode.USAGE);
    expect(JSON.parse(result.stdout)).toMatchObject({
      command: 'usage',
      ok: false,
      exit_code: 2,
      error: { message: expect.stringMatching(/bad capture key/) },
    });
  });

  test('a stack file that does not exist is a failure (exit 1), as one JSON document with --json', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-cli-'));
    try {
      const human = await run(['status', '--config', 'missing.yaml'], dir);
      expect(human.code).toBe(ExitCode.FAILURE);
      expect(human.stderr).toMatch(/^ckpt-gym status: .*missing\.yaml: cannot read the stack file/);
      expect(human.stdout).toBe('');
      const json = await run(['status', '--config', 'missing.yaml', '--json'], dir);
      expect(JSON.parse(json.stdout)).toMatchObject({ command: 'status', ok: false, exit_code: 1 });
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test('without --config and ./ckpt-gym.yaml the bundled example is used', async () => {
    expect(existsSync(BUNDLED_EXAMPLE)).toBe(true);
    const dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-cli-'));
    try {
      // Nothing listens on the example's ports: every server is reported, none reached.
      const result = await run(['status', '--json', '--deadline', '2'], dir);
      const doc = JSON.parse(result.stdout) as {
        config: string;
        servers: { server: string; error?: string }[];
      };
      expect(doc.config).toBe(BUNDLED_EXAMPLE);
      expect(doc.servers.map((s) => s.server)).toEqual([
        'policy',
        'weather',
        'counter',
        'simple_agent',
        'env',
      ]);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
