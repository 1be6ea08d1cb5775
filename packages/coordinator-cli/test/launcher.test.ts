/**
 * `up`, `status`, `checkpoint`, `crash`, `up` again, `restore`, `down` against a real local stack:
 * every server a spawned process (the built packages), driven through runCli in-process.
 */
import { spawn } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { until } from '@ckpt-gym/testing';

import {
  attachStack,
  demoStackText,
  ExitCode,
  freePort,
  isServerProcess,
  RUN_FILE,
  SERVER_GLIBC_TUNABLE,
  SERVER_NODE_FLAGS,
  weatherTask,
} from '../src/index.js';
import { ensureBuilt } from './support/build.js';
import { cli, isAlive } from './support/cli.js';

interface ServerRow {
  name: string;
  kind: string;
  pid: number;
  url: string;
}

let dir = '';

beforeAll(() => ensureBuilt(), 300_000);

beforeEach(() => {
  dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-launcher-'));
});

afterEach(async () => {
  // Whatever the test left running dies here, inference backend included.
  if (existsSync(join(dir, 'run', RUN_FILE)))
    await attachStack(join(dir, 'run')).crash({ all: true });
  rmSync(dir, { recursive: true, force: true });
});

async function post(url: string, body: unknown): Promise<Response> {
  return fetch(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
}

function runBody(attempt: number) {
  return { episode_id: { rollout_id: 'r1', attempt }, task: weatherTask(1) };
}

test('up, status, checkpoint, crash, up again, restore, down on a real stack', async () => {
  writeFileSync(
    join(dir, 'stack.yaml'),
    demoStackText(await freePort('127.0.0.1'), 'launcher-token'),
  );
  const up = await cli(
    ['up', '--detach', '--run-dir', 'run', '--config', 'stack.yaml', '--json'],
    dir,
  );
  expect(up.code).toBe(ExitCode.OK);
  const servers = up.json().servers as ServerRow[];
  expect(servers.map((s) => s.kind)).toEqual([
    'inference',
    'resources',
    'resources',
    'model',
    'agent',
    'agent',
    'environment',
    'environment',
  ]);
  expect(servers.every((s) => isAlive(s.pid))).toBe(true);
  // Each server runs node with the launcher's flags (a larger young generation) and its malloc
  // on transparent huge pages.
  for (const s of servers) {
    const argv = readFileSync(`/proc/${s.pid}/cmdline`, 'utf8').split('\0');
    expect([s.name, argv.slice(1, 1 + SERVER_NODE_FLAGS.length)]).toEqual([
      s.name,
      SERVER_NODE_FLAGS,
    ]);
    const environ = readFileSync(`/proc/${s.pid}/environ`, 'utf8').split('\0');
    const tunables = environ.find((v) => v.startsWith('GLIBC_TUNABLES=')) ?? '';
    expect([s.name, tunables.slice('GLIBC_TUNABLES='.length).split(':')]).toEqual([
      s.name,
      expect.arrayContaining([SERVER_GLIBC_TUNABLE]),
    ]);
  }
  const resolved = join(dir, 'run', 'stack.yaml');
  const url = (name: string) => servers.find((s) => s.name === name)!.url;

  const status = await cli(['status', '--config', resolved, '--json'], dir);
  expect(status.code).toBe(ExitCode.OK);

  // One rollout held at its second model call, then checkpointed with stop.
  await post(`${url('inference')}/_ctl/hold`, { after_calls_per_rollout: 1 });
  const first = post(`${url('env')}/run`, runBody(0)).catch(() => undefined);
  await until(
    async () => {
      const { calls } = (await (await fetch(`${url('inference')}/_ctl/calls`)).json()) as {
        calls: { held: boolean; returned: boolean }[];
      };
      return calls.some((c) => c.held && !c.returned);
    },
    'the second model call to be held',
    30_000,
  );
  const cut = await cli(
    ['checkpoint', '--dir', 'ckpt', '--stop', '--config', resolved, '--json'],
    dir,
  );
  expect(cut.code).toBe(ExitCode.OK);
  expect(cut.json().exported).toEqual(['r1']);

  const crash = await cli(['crash', '--run-dir', 'run', '--json'], dir);
  expect(crash.code).toBe(ExitCode.OK);
  expect(crash.json().killed).toEqual(
    servers.filter((s) => s.kind !== 'inference').map((s) => s.name),
  );
  await first;
  for (const s of servers)
    expect([s.name, isAlive(s.pid)]).toEqual([s.name, s.kind === 'inference']);

  const again = await cli(['up', '--detach', '--run-dir', 'run', '--json'], dir);
  expect(again.code).toBe(ExitCode.OK);
  const fresh = again.json().servers as ServerRow[];
  expect(fresh.map((s) => s.url)).toEqual(servers.map((s) => s.url));
  expect(fresh.every((s) => isAlive(s.pid))).toBe(true);

  const restored = await cli(['restore', '--dir', 'ckpt', '--config', resolved, '--json'], dir);
  expect(restored.code).toBe(ExitCode.OK);
  expect(restored.json().restored).toEqual(['r1-a1']);
  expect((await cli(['resume', '--config', resolved], dir)).code).toBe(ExitCode.OK);
  await post(`${url('inference')}/_ctl/release`, {});
  const reply = (await (await post(`${url('env')}/run`, runBody(1))).json()) as {
    result: { reward: number } | null;
  };
  expect(reply.result?.reward).toBe(1);

  const down = await cli(['down', '--run-dir', 'run', '--json'], dir);
  expect(down.code).toBe(ExitCode.OK);
  expect(fresh.some((s) => isAlive(s.pid))).toBe(false);
  expect(existsSync(join(dir, 'run', RUN_FILE))).toBe(false);
}, 180_000);

test('a run file whose pids now belong to other programs signals none of them', async () => {
  writeFileSync(join(dir, 'stack.yaml'), demoStackText(await freePort('127.0.0.1'), 't'));
  // A process group that is not a `serve` process, as after a reboot gave the pid away.
  const other = spawn('sleep', ['30'], { detached: true, stdio: 'ignore' });
  try {
    mkdirSync(join(dir, 'run'));
    writeFileSync(join(dir, 'run', 'stack.yaml'), readFileSync(join(dir, 'stack.yaml')));
    writeFileSync(
      join(dir, 'run', RUN_FILE),
      JSON.stringify({
        config_path: join(dir, 'run', 'stack.yaml'),
        source_path: join(dir, 'stack.yaml'),
        servers: [
          {
            name: 'env',
            kind: 'environment',
            pid: other.pid,
            port: 1,
            url: 'http://127.0.0.1:1',
            log_path: '',
          },
        ],
      }),
    );
    expect(isServerProcess(other.pid!, 'env')).toBe(false);
    expect((await cli(['crash', '--run-dir', 'run'], dir)).code).toBe(ExitCode.OK);
    expect((await cli(['down', '--run-dir', 'run', '--grace', '0'], dir)).code).toBe(ExitCode.OK);
    expect(isAlive(other.pid!)).toBe(true);
  } finally {
    other.kill('SIGKILL');
  }
});
