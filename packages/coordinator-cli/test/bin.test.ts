/** The built bin, as a user runs it. */
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

const repo = fileURLToPath(new URL('../../../', import.meta.url));
const bin = join(repo, 'packages/coordinator-cli/dist/main.js');

function build(pkg: string): void {
  const tsc = join(repo, 'node_modules/typescript/bin/tsc');
  const result = spawnSync(
    process.execPath,
    [tsc, '-p', join(repo, 'packages', pkg, 'tsconfig.build.json')],
    {
      encoding: 'utf8',
    },
  );
  if (result.status !== 0)
    throw new Error(`building ${pkg} failed:\n${result.stdout}${result.stderr}`);
}

beforeAll(() => {
  if (!existsSync(join(repo, 'packages/core/dist/index.js'))) build('core');
  if (!existsSync(bin)) build('coordinator-cli');
}, 120_000);

describe('the ckpt-gym bin', () => {
  test('--help prints the usage and exits 0', () => {
    const result = spawnSync(process.execPath, [bin, '--help'], { encoding: 'utf8' });
    expect(result.status).toBe(0);
    expect(result.stdout).toMatch(/^usage: ckpt-gym <command> \[options\]/);
  });

  test('an unknown command exits 2', () => {
    const result = spawnSync(process.execPath, [bin, 'frobnicate'], { encoding: 'utf8' });
    expect(result.status).toBe(2);
    expect(result.stderr).toMatch(/unknown command 'frobnicate'/);
  });
});
