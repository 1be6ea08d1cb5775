/**
 * `down` and `crash` when nothing runs succeed and say so (cleanup scripts run them
 * unconditionally), and `down` echoes --grace in seconds: real `serve` processes through runCli.
 */
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { attachStack, ExitCode, RUN_FILE } from '../src/index.js';
import { ensureBuilt } from './support/build.js';
import { cli, isAlive } from './support/cli.js';

let dir = '';

beforeAll(() => ensureBuilt(), 300_000);

beforeEach(() => {
  dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-down-'));
  writeFileSync(
    join(dir, 'stack.yaml'),
    [
      'checkpoint: { enabled: true, control_auth_token: down-token }',
      'servers:',
      '  weather: { kind: resources, app: weather, port: 0 }',
      '',
    ].join('\n'),
  );
});

afterEach(async () => {
  if (existsSync(join(dir, 'run', RUN_FILE)))
    await attachStack(join(dir, 'run')).crash({ all: true });
  rmSync(dir, { recursive: true, force: true });
});

async function up(): Promise<number> {
  const started = await cli(
    ['up', '--detach', '--config', 'stack.yaml', '--run-dir', 'run', '--json'],
    dir,
  );
  expect(started.code).toBe(ExitCode.OK);
  const [weather] = started.json().servers as { name: string; pid: number }[];
  expect(weather?.name).toBe('weather');
  return weather?.pid ?? 0;
}

describe.each([
  ['down', 'stop', 'stopped'],
  ['crash', 'kill', 'killed'],
])('%s with nothing running', (command, verb, list) => {
  test(`without a run file: "nothing to ${verb}", exit 0`, async () => {
    const human = await cli([command, '--run-dir', 'never'], dir);
    expect(human).toMatchObject({
      code: ExitCode.OK,
      stdout: `nothing to ${verb}: no server of the stack of ${join(dir, 'never')} is running\n`,
    });
    const json = await cli([command, '--run-dir', 'never', '--json'], dir);
    expect(json.code).toBe(ExitCode.OK);
    expect(json.json()).toEqual({
      command,
      ok: true,
      exit_code: 0,
      run_dir: join(dir, 'never'),
      [list]: [],
      [`nothing_to_${verb}`]: true,
    });
  });

  test(`with a run file whose servers are all gone: "nothing to ${verb}", exit 0`, async () => {
    const pid = await up();
    await attachStack(join(dir, 'run')).crash({ all: true });
    expect(isAlive(pid)).toBe(false);
    const result = await cli([command, '--run-dir', 'run', '--json'], dir);
    expect(result.code).toBe(ExitCode.OK);
    expect(result.json()).toMatchObject({ ok: true, [list]: [], [`nothing_to_${verb}`]: true });
    // down forgets the dead stack; crash keeps its run file for `up` to restart it.
    expect(existsSync(join(dir, 'run', RUN_FILE))).toBe(command === 'crash');
  }, 60_000);
});

test('down echoes --grace in seconds, stops the running servers and removes the run file', async () => {
  const pid = await up();
  const down = await cli(['down', '--run-dir', 'run', '--grace', '2.5', '--json'], dir);
  expect(down.code).toBe(ExitCode.OK);
  expect(down.stderr).toBe('stopping 1 server(s) (grace 2.5 s) …\n');
  expect(down.json()).toMatchObject({ ok: true, stopped: ['weather'], nothing_to_stop: false });
  expect(isAlive(pid)).toBe(false);
  expect(existsSync(join(dir, 'run', RUN_FILE))).toBe(false);
}, 60_000);

test('crash SIGKILLs only what is running and names it', async () => {
  const pid = await up();
  const crash = await cli(['crash', '--run-dir', 'run', '--json'], dir);
  expect(crash.code).toBe(ExitCode.OK);
  expect(crash.json()).toMatchObject({ ok: true, killed: ['weather'], nothing_to_kill: false });
  expect(isAlive(pid)).toBe(false);
}, 60_000);
