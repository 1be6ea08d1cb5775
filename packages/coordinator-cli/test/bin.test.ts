/**
 * The bins as a user runs them: every workspace bin is a committed, executable launcher that npm
 * can link before any build, says so when the package is not built, and runs the CLI when it is.
 */
import { spawnSync } from 'node:child_process';
import { copyFileSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, relative } from 'node:path';

import { ensureBuilt, REPO } from './support/build.js';

interface WorkspaceBin {
  readonly name: string;
  /** Relative to the repository root. */
  readonly path: string;
  /** The directory of the package that declares it, relative to the repository root. */
  readonly packageDir: string;
}

interface Manifest {
  readonly name?: string;
  readonly version?: string;
  readonly workspaces?: string[];
  readonly bin?: string | Record<string, string>;
}

function readJson(path: string): Manifest {
  return JSON.parse(readFileSync(path, 'utf8')) as Manifest;
}

/** The root's workspaces: `dir/*` patterns and plain directories. */
function workspaceDirs(): string[] {
  return (readJson(join(REPO, 'package.json')).workspaces ?? []).flatMap((pattern) =>
    pattern.endsWith('/*')
      ? readdirSync(join(REPO, pattern.slice(0, -2)), { withFileTypes: true })
          .filter((entry) => entry.isDirectory())
          .map((entry) => join(pattern.slice(0, -2), entry.name))
      : [pattern],
  );
}

function workspaceBins(): WorkspaceBin[] {
  return workspaceDirs().flatMap((packageDir) => {
    const manifest = readJson(join(REPO, packageDir, 'package.json'));
    const bins =
      typeof manifest.bin === 'string'
        ? { [manifest.name ?? packageDir]: manifest.bin }
        : (manifest.bin ?? {});
    return Object.entries(bins).map(([name, target]) => ({
      name,
      path: relative(REPO, join(REPO, packageDir, target)),
      packageDir,
    }));
  });
}

const BINS = workspaceBins();
const cliBin = join(REPO, 'packages/coordinator-cli/bin/ckpt-gym.js');

beforeAll(() => ensureBuilt(), 300_000);

test("the workspace declares the ckpt-gym bin, the fake backend's and one per server package", () => {
  expect(BINS.map((bin) => bin.name).sort()).toEqual([
    'ckpt-gym',
    'ckpt-gym-agent',
    'ckpt-gym-environment',
    'ckpt-gym-fake-inference',
    'ckpt-gym-policy-model',
    'ckpt-gym-resources',
  ]);
});

describe.each(BINS)('the $name bin', (bin) => {
  test('is a file committed in git with the execute bit (mode 100755), not a build output', () => {
    const listed = spawnSync('git', ['ls-files', '--stage', '--', bin.path], {
      cwd: REPO,
      encoding: 'utf8',
    });
    expect(listed.status).toBe(0);
    // One `<mode> <object> <stage>\t<path>` line: a clone has it before any build.
    const [entry, path, ...more] = listed.stdout.split(/[\t\n]/);
    expect([entry, path, more]).toEqual([
      expect.stringMatching(/^100755 [0-9a-f]+ 0$/),
      bin.path,
      [''],
    ]);
  });

  test('says to run the build, exit 1, when its package has no dist/', () => {
    const copy = mkdtempSync(join(tmpdir(), 'ckpt-gym-unbuilt-'));
    try {
      // The package as a fresh clone has it: its manifest (ESM) and the launcher, no dist/.
      const relativeBin = relative(bin.packageDir, bin.path);
      mkdirSync(join(copy, dirname(relativeBin)), { recursive: true });
      copyFileSync(join(REPO, bin.packageDir, 'package.json'), join(copy, 'package.json'));
      copyFileSync(join(REPO, bin.path), join(copy, relativeBin));
      const result = spawnSync(process.execPath, [join(copy, relativeBin), '--help'], {
        encoding: 'utf8',
      });
      expect(result).toMatchObject({
        status: 1,
        stdout: '',
        stderr: `${bin.name}: not built yet; run npm run build first\n`,
      });
    } finally {
      rmSync(copy, { recursive: true, force: true });
    }
  });

  test('runs the built program when executed directly: --help exits 0 with the usage', () => {
    const result = spawnSync(join(REPO, bin.path), ['--help'], { encoding: 'utf8' });
    expect(result.status).toBe(0);
    expect(result.stdout).toMatch(new RegExp(`^usage: ${bin.name} `));
  });
});

describe('ckpt-gym through its bin', () => {
  test('--version prints the package version and exits 0', () => {
    const { version } = readJson(join(REPO, 'packages/coordinator-cli/package.json'));
    const result = spawnSync(cliBin, ['--version'], { encoding: 'utf8' });
    expect(result).toMatchObject({ status: 0, stdout: `${version}\n`, stderr: '' });
  });

  test('an unknown command exits 2', () => {
    const result = spawnSync(cliBin, ['frobnicate'], { encoding: 'utf8' });
    expect(result.status).toBe(2);
    expect(result.stderr).toMatch(/unknown command 'frobnicate'/);
  });
});
