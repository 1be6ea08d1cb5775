/**
 * `up` on ports something else already holds: another stack from the same file (whose servers
 * answer the health routes), or a plain socket. `up` must fail naming the server and the port it
 * could not bind, and leave the other stack alone.
 */
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createServer as createNetServer, type AddressInfo, type Server } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import {
  attachStack,
  CLI_MAIN,
  demoStackText,
  ExitCode,
  freePort,
  RUN_FILE,
} from '../src/index.js';
import { ensureBuilt } from './support/build.js';
import { cli, type CliRun, isAlive } from './support/cli.js';

interface ServerRow {
  name: string;
  kind: string;
  pid: number;
  port: number;
  url: string;
}

interface Identity {
  pid: number;
  launch_id: string;
}

let dir = '';
const sockets: Server[] = [];

beforeAll(() => ensureBuilt(), 300_000);

beforeEach(() => {
  dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-up-ports-'));
});

afterEach(async () => {
  for (const socket of sockets.splice(0)) socket.close();
  // Every stack a test left running dies here, inference backend included.
  for (const runDir of readdirSync(dir)) {
    if (existsSync(join(dir, runDir, RUN_FILE)))
      await attachStack(join(dir, runDir)).crash({ all: true });
  }
  rmSync(dir, { recursive: true, force: true });
});

/** The CLI as a user runs it: its own process, with its own exit code. */
function cliProcess(argv: string[], cwd: string): Promise<CliRun> {
  return new Promise((done, failed) => {
    const child = spawn(process.execPath, [CLI_MAIN, ...argv], { cwd, env: process.env });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (chunk: Buffer) => (stdout += chunk.toString()));
    child.stderr.on('data', (chunk: Buffer) => (stderr += chunk.toString()));
    child.once('error', failed);
    child.once('close', (code) =>
      done({
        code: code ?? -1,
        stdout,
        stderr,
        json: () => JSON.parse(stdout) as Record<string, unknown>,
      }),
    );
  });
}

/** The demo stack with every port fixed, so a second `up` of the same file takes the same ports. */
async function fixedPortStack(): Promise<string> {
  const backend = await freePort('127.0.0.1');
  const text = demoStackText(backend, 'up-ports-token');
  const zeros = text.match(/port: 0\b/g)?.length ?? 0;
  const ports = await Promise.all(Array.from({ length: zeros }, () => freePort('127.0.0.1')));
  return text.replace(/port: 0\b/g, () => `port: ${ports.shift()}`);
}

async function identity(url: string): Promise<Identity> {
  const { pid, launch_id } = (await (await fetch(`${url}/health`)).json()) as Identity;
  return { pid, launch_id };
}

test('up --detach on the ports of a running stack exits 1 naming the server and port it could not bind; the running stack is untouched', async () => {
  writeFileSync(join(dir, 'stack.yaml'), await fixedPortStack());
  const first = await cli(
    ['up', '--detach', '--run-dir', 'first', '--config', 'stack.yaml', '--json'],
    dir,
  );
  expect(first.code).toBe(ExitCode.OK);
  const servers = first.json().servers as ServerRow[];
  const before = await Promise.all(servers.map((s) => identity(s.url)));
  const runFile = readFileSync(join(dir, 'first', RUN_FILE), 'utf8');
  const inference = servers.find((s) => s.name === 'inference')!;
  const holder = `another process (pid ${inference.pid}, inference 'inference')`;

  const second = await cliProcess(
    ['up', '--detach', '--run-dir', 'second', '--config', 'stack.yaml'],
    dir,
  );
  expect(second.code).toBe(ExitCode.FAILURE);
  expect(second.stdout).not.toMatch(/stack up/);
  expect(second.stderr).toContain(
    `ckpt-gym up: inference could not bind 127.0.0.1:${inference.port} (EADDRINUSE) and exited (exit code 1); ` +
      `port ${inference.port} is answered by ${holder}, not by this launch`,
  );
  expect(second.stderr).toMatch(
    new RegExp(`\\ninference +127\\.0\\.0\\.1:${inference.port}: EADDRINUSE\\n`),
  );
  // The backend comes first and nothing after it was started; its log says why it stopped.
  expect(readdirSync(join(dir, 'second', 'logs'))).toEqual(['inference.log']);
  expect(readFileSync(join(dir, 'second', 'logs', 'inference.log'), 'utf8')).toMatch(
    /listen EADDRINUSE: address already in use/,
  );
  expect(existsSync(join(dir, 'second', RUN_FILE))).toBe(false);

  const third = await cliProcess(
    ['up', '--detach', '--run-dir', 'third', '--config', 'stack.yaml', '--json'],
    dir,
  );
  expect(third.code).toBe(ExitCode.FAILURE);
  const report = third.json();
  expect(report).toMatchObject({ command: 'up', ok: false, exit_code: ExitCode.FAILURE });
  expect(report.failed).toEqual([
    {
      server: 'inference',
      host: '127.0.0.1',
      port: inference.port,
      reason: 'EADDRINUSE',
      answered_by: holder,
    },
  ]);
  expect((report.error as { failures: unknown }).failures).toEqual({
    inference: `127.0.0.1:${inference.port}: EADDRINUSE`,
  });

  // The first stack: the same processes, each still answering its own port, its run file as it was.
  expect(servers.map((s) => [s.name, isAlive(s.pid)])).toEqual(servers.map((s) => [s.name, true]));
  expect(await Promise.all(servers.map((s) => identity(s.url)))).toEqual(before);
  expect(before.map((b) => b.pid)).toEqual(servers.map((s) => s.pid));
  expect(readFileSync(join(dir, 'first', RUN_FILE), 'utf8')).toBe(runFile);
}, 180_000);

test('restarting what is down, and a foreground up, fail the same way on a port another stack holds', async () => {
  const port = await freePort('127.0.0.1');
  writeFileSync(
    join(dir, 'stack.yaml'),
    `servers:\n  counter: { kind: resources, app: counter, port: ${port} }\n`,
  );
  const up = (runDir: string, ...more: string[]) =>
    cli(['up', '--run-dir', runDir, '--config', 'stack.yaml', '--json', ...more], dir);
  expect((await up('b', '--detach')).code).toBe(ExitCode.OK);
  expect((await cli(['crash', '--all', '--run-dir', 'b'], dir)).code).toBe(ExitCode.OK);
  const a = await up('a', '--detach');
  expect(a.code).toBe(ExitCode.OK);
  const holder = (a.json().servers as ServerRow[])[0]!;
  const expected = {
    server: 'counter',
    host: '127.0.0.1',
    port,
    reason: 'EADDRINUSE',
    answered_by: `another process (pid ${holder.pid}, resources 'counter')`,
  };

  // b's run file names counter, which is down: `up` restarts it, on the port a now holds.
  const restart = await cli(['up', '--detach', '--run-dir', 'b', '--json'], dir);
  expect(restart.code).toBe(ExitCode.FAILURE);
  expect(restart.json().failed).toEqual([expected]);

  const foreground = await up('c');
  expect(foreground.code).toBe(ExitCode.FAILURE);
  expect(foreground.json().failed).toEqual([expected]);

  expect(isAlive(holder.pid)).toBe(true);
  expect((await identity(holder.url)).pid).toBe(holder.pid);
}, 120_000);

/** A socket that accepts connections and never answers: nothing answers a health route on it. */
async function silentSocket(): Promise<number> {
  const socket = createNetServer(() => undefined);
  sockets.push(socket);
  await new Promise<void>((done) => socket.listen(0, '127.0.0.1', done));
  return (socket.address() as AddressInfo).port;
}

test('servers that die at start on ports plain sockets hold are each reported from their exit, with the listen error', async () => {
  const [counter, weather] = [await silentSocket(), await silentSocket()];
  writeFileSync(
    join(dir, 'stack.yaml'),
    'servers:\n' +
      `  counter: { kind: resources, app: counter, port: ${counter} }\n` +
      `  weather: { kind: resources, app: weather, port: ${weather} }\n`,
  );

  const up = await cliProcess(
    ['up', '--detach', '--run-dir', 'run', '--config', 'stack.yaml', '--json'],
    dir,
  );
  expect(up.code).toBe(ExitCode.FAILURE);
  const report = up.json();
  // The two start side by side (one kind): both are named, not only the first to fail.
  expect(report.failed).toEqual([
    { server: 'counter', host: '127.0.0.1', port: counter, reason: 'EADDRINUSE' },
    { server: 'weather', host: '127.0.0.1', port: weather, reason: 'EADDRINUSE' },
  ]);
  const message = (report.error as { message: string }).message;
  for (const [name, port] of [
    ['counter', counter],
    ['weather', weather],
  ] as const) {
    expect(message).toMatch(
      new RegExp(
        `^${name} could not bind 127\\.0\\.0\\.1:${port} \\(EADDRINUSE\\) and exited \\(exit code 1\\):$`,
        'm',
      ),
    );
  }
}, 60_000);
