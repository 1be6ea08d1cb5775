/**
 * `checkpoint.signing_key` through the CLI: `ckpt-gym checkpoint` signs every manifest and
 * `controller.json`, and `ckpt-gym restore --dir` into fresh servers refuses a forged scope.
 */
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { runCli } from '../src/index.js';
import { type CliRun, startStack, type TestStack, TOKEN_ENV } from './support/stack.js';

const KEY = 'a-cli-signing-key-that-is-32-bytes-long';

let dir: string;
const stacks: TestStack[] = [];

async function cli(args: string[], config: string): Promise<CliRun> {
  const out = { stdout: '', stderr: '' };
  const code = await runCli([...args, '--config', config], {
    stdout: { write: (chunk: string) => (out.stdout += chunk) },
    stderr: { write: (chunk: string) => (out.stderr += chunk) },
    env: { [TOKEN_ENV]: 'test-token' },
    cwd: dir,
  });
  return { code, ...out };
}

async function signedStack(file: string): Promise<TestStack> {
  const started = await startStack(dir, undefined, { file, signingKey: KEY });
  stacks.push(started);
  return started;
}

beforeEach(() => {
  dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-signing-cli-'));
});

afterEach(async () => {
  await Promise.all(stacks.splice(0).map((s) => s.close()));
  rmSync(dir, { recursive: true, force: true });
});

test('a signed checkpoint restores; its controller.json forged to drop an episode is refused', async () => {
  const stack = await signedStack('stack.yaml');
  stack.participant('env').start('r1');
  stack.participant('env').start('r2');
  expect((await cli(['checkpoint', '--dir', 'ckpt', '--id', 'src'], stack.file)).code).toBe(0);

  const controllerPath = join(dir, 'ckpt', 'controller.json');
  const published = JSON.parse(readFileSync(controllerPath, 'utf8')) as Record<string, unknown>;
  expect(published.mac).toMatch(/^hmac-sha256:[0-9a-f]{64}$/);
  const manifest = JSON.parse(
    readFileSync(join(dir, 'ckpt', 'gym', 'environment', 'env', 'manifest.json'), 'utf8'),
  ) as Record<string, unknown>;
  expect(manifest.mac).toMatch(/^hmac-sha256:[0-9a-f]{64}$/);

  writeFileSync(controllerPath, JSON.stringify({ ...published, episode_ids: ['r1'] }));
  const forged = await signedStack('forged.yaml');
  const refused = await cli(['restore', '--dir', 'ckpt', '--id', 'back'], forged.file);
  expect(refused.code).toBe(1);
  expect(refused.stderr).toContain(`${controllerPath} has a MAC that does not verify`);
  expect(forged.participant('env').restored.size).toBe(0);

  writeFileSync(controllerPath, `${JSON.stringify(published, null, 2)}\n`);
  const fresh = await signedStack('fresh.yaml');
  const restored = await cli(['restore', '--dir', 'ckpt', '--id', 'back', '--json'], fresh.file);
  expect(restored.code).toBe(0);
  expect([...fresh.participant('env').restored.keys()].sort()).toEqual(['r1-a1', 'r2-a1']);
});
