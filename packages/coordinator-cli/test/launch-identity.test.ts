/**
 * The rule that a health reply proves the launched child (its pid and its launch nonce), the error
 * naming the server and port that did not come up, and the health wait against real processes.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { createServer as createHttpServer, type Server } from 'node:http';
import { createServer as createNetServer, type AddressInfo } from 'node:net';

import { LAUNCH_ID_ENV } from '@ckpt-gym/core/server';
import { until } from '@ckpt-gym/testing';

import {
  answererOf,
  awaitOwnHealth,
  freePort,
  hasListeningLine,
  launchFailure,
  listenErrorCode,
  parentPid,
  provesLaunchedChild,
} from '../src/launcher.js';

const CHILD = { pid: 4242, launchId: 'launch-a' };
const REPLY = { status: 'ok', name: 'env', kind: 'environment', pid: 4242, launch_id: 'launch-a' };

describe('provesLaunchedChild', () => {
  test("a reply with the child's pid and launch id proves it", () => {
    expect(provesLaunchedChild(REPLY, CHILD)).toBe(true);
  });

  test.each([
    ['another pid (another process on the port)', { ...REPLY, pid: 4243 }],
    ['another launch id (an older launch, or a reused pid)', { ...REPLY, launch_id: 'launch-b' }],
    ['no launch id (a process started without this launcher)', { ...REPLY, launch_id: null }],
    ['no pid (a server from before /health named its process)', { status: 'ok', name: 'env' }],
    ['a status other than ok', { ...REPLY, status: 'starting' }],
    ['a pid as a string', { ...REPLY, pid: '4242' }],
    ['not JSON', undefined],
    ['null', null],
    ['an array', [REPLY]],
  ])('%s does not', (_what, body) => {
    expect(provesLaunchedChild(body, CHILD)).toBe(false);
  });
});

describe('provesLaunchedChild, a server with several workers', () => {
  const parents: Record<number, number> = { 5001: 4242, 5002: 4242, 6001: 9999 };
  const parentOf = (pid: number): number | undefined => parents[pid];

  test('a reply from a worker the child forked, with its launch id, proves it', () => {
    expect(provesLaunchedChild({ ...REPLY, pid: 5001 }, CHILD, parentOf)).toBe(true);
  });

  test.each([
    ["another process's worker", { ...REPLY, pid: 6001 }],
    [
      'a worker of the child with another launch id',
      { ...REPLY, pid: 5002, launch_id: 'launch-b' },
    ],
    ['a process whose parent cannot be read', { ...REPLY, pid: 7001 }],
  ])('%s does not', (_what, body) => {
    expect(provesLaunchedChild(body, CHILD, parentOf)).toBe(false);
  });

  test("a real child's child is proved by /proc, another process is not", () => {
    expect(parentPid(process.pid)).toBe(process.ppid);
    const child = { pid: process.ppid, launchId: 'launch-a' };
    expect(provesLaunchedChild({ ...REPLY, pid: process.pid }, child)).toBe(true);
    expect(
      provesLaunchedChild({ ...REPLY, pid: process.ppid }, { ...child, pid: process.pid }),
    ).toBe(false);
  });
});

describe('hasListeningLine', () => {
  test("finds serve's listening line among the log's lines", () => {
    const line = '{"event":"listening","server":"policy","kind":"model","port":1}';
    expect(hasListeningLine(`{"level":"info","message":"x"}\n${line}\n`)).toBe(true);
    expect(hasListeningLine(line)).toBe(true);
  });

  test('a log without it, or naming it elsewhere in a line, has none', () => {
    expect(hasListeningLine('')).toBe(false);
    expect(hasListeningLine('{"level":"info","message":"{\\"event\\":\\"listening\\"}"}\n')).toBe(
      false,
    );
  });
});

describe('answererOf', () => {
  test('names the process a health reply says it is', () => {
    expect(answererOf({ status: 200, body: { ...REPLY, pid: 77 } })).toBe(
      "another process (pid 77, environment 'env')",
    );
  });

  test('a reply without a pid is named by its status', () => {
    expect(answererOf({ status: 404, body: { error: 'nope' } })).toBe(
      'a server that answers HTTP 404 without a pid',
    );
    expect(answererOf({ status: 200, body: undefined })).toBe(
      'a server that answers HTTP 200 without a pid',
    );
  });
});

describe('listenErrorCode', () => {
  test("finds the system error of a failed listen in the serve process's log", () => {
    const log =
      '{"level":"info","message":"starting"}\n' +
      'ckpt-gym serve: unexpected error: listen EADDRINUSE: address already in use 127.0.0.1:8101\n';
    expect(listenErrorCode(log)).toBe('EADDRINUSE');
    expect(
      listenErrorCode('ckpt-gym serve: unexpected error: listen EACCES: permission denied'),
    ).toBe('EACCES');
  });

  test('a log without a failed listen gives none', () => {
    expect(listenErrorCode('ckpt-gym serve: servers.env.agent_server: is required\n')).toBe(
      undefined,
    );
    expect(listenErrorCode('')).toBe(undefined);
  });
});

describe('launchFailure', () => {
  const server = {
    name: 'inference',
    host: '127.0.0.1',
    port: 8101,
    healthUrl: 'http://127.0.0.1:8101/health',
  };
  const inUse = 'ckpt-gym serve: unexpected error: listen EADDRINUSE: address already in use\n';

  test('a child that could not bind names its port, the listen error and who holds the port', () => {
    const err = launchFailure(
      server,
      { kind: 'exited', exit: 'exit code 1', answeredBy: 'another process (pid 9)' },
      inUse,
    );
    expect(err.message).toBe(
      'inference could not bind 127.0.0.1:8101 (EADDRINUSE) and exited (exit code 1); ' +
        'port 8101 is answered by another process (pid 9), not by this launch:\n' +
        inUse.trimEnd(),
    );
    expect(err.failures).toEqual([
      {
        server: 'inference',
        host: '127.0.0.1',
        port: 8101,
        reason: 'EADDRINUSE',
        answered_by: 'another process (pid 9)',
      },
    ]);
  });

  test('a child that exited for another reason is named with its exit', () => {
    const err = launchFailure(server, { kind: 'exited', exit: 'SIGKILL' }, '');
    expect(err.message).toBe(
      'inference exited (SIGKILL) before it was healthy on 127.0.0.1:8101:\n(no log)',
    );
    expect(err.failures).toEqual([
      { server: 'inference', host: '127.0.0.1', port: 8101, reason: 'exited (SIGKILL)' },
    ]);
  });

  test('a timeout names the health route and the time waited', () => {
    const err = launchFailure(server, { kind: 'timeout', afterMs: 500 }, 'line\n');
    expect(err.message).toBe(
      'inference not healthy at http://127.0.0.1:8101/health within 500 ms:\nline',
    );
    expect(err.failures[0]?.reason).toBe('not healthy within 500 ms');
  });
});

describe('awaitOwnHealth against real processes', () => {
  /** Longer than any test may run: only the child's exit or its own reply ends these waits. */
  const NEVER_MS = 10 * 60_000;
  const children: ChildProcess[] = [];
  const servers: { close(): unknown }[] = [];

  afterEach(() => {
    for (const child of children.splice(0)) child.kill('SIGKILL');
    for (const server of servers.splice(0)) server.close();
  });

  function node(script: string, env: NodeJS.ProcessEnv = {}): ChildProcess {
    const child = spawn(process.execPath, ['-e', script], {
      stdio: 'ignore',
      env: { ...process.env, ...env },
    });
    children.push(child);
    return child;
  }

  /** A server on a free port answering every request with `reply`, as an older stack would. */
  async function foreignHealth(reply: unknown): Promise<number> {
    const server: Server = createHttpServer((_req, res) => {
      res.setHeader('content-type', 'application/json');
      res.end(JSON.stringify(reply));
    });
    servers.push(server);
    await new Promise<void>((done) => server.listen(0, '127.0.0.1', done));
    return (server.address() as AddressInfo).port;
  }

  /** What `serve` does: listen on the port, and answer /health with this process's identity. */
  const serveScript = (port: number) =>
    `require('node:http').createServer((q, s) => s.end(JSON.stringify({ status: 'ok', ` +
    `pid: process.pid, launch_id: process.env.${LAUNCH_ID_ENV} }))).listen(${port}, '127.0.0.1')`;

  test('the child answering with its own pid and launch id is healthy', async () => {
    const port = await freePort('127.0.0.1');
    const child = node(serveScript(port), { [LAUNCH_ID_ENV]: 'mine' });
    const outcome = await awaitOwnHealth(
      child,
      { pid: child.pid!, launchId: 'mine' },
      `http://127.0.0.1:${port}/health`,
      NEVER_MS,
    );
    expect(outcome).toEqual({ kind: 'healthy' });
  });

  test('a child answering its health route is not up before its listening line (every worker listening)', async () => {
    const port = await freePort('127.0.0.1');
    const child = node(serveScript(port), { [LAUNCH_ID_ENV]: 'mine' });
    let announced = false;
    let settled = false;
    const waiting = awaitOwnHealth(
      child,
      { pid: child.pid!, launchId: 'mine' },
      `http://127.0.0.1:${port}/health`,
      NEVER_MS,
      () => announced,
    ).finally(() => (settled = true));
    await until(
      () =>
        fetch(`http://127.0.0.1:${port}/health`).then(
          (r) => r.ok,
          () => false,
        ),
      'the child answers its health route',
    );
    // Several polls of its proven health reply later, still waiting for the line.
    await new Promise((done) => setTimeout(done, 300));
    expect(settled).toBe(false);
    announced = true;
    expect(await waiting).toEqual({ kind: 'healthy' });
  });

  test('a child that dies on a port another server answers ends the wait at its exit', async () => {
    const holder = { status: 'ok', name: 'old', kind: 'resources', pid: process.pid };
    const port = await foreignHealth({ ...holder, launch_id: 'old-launch' });
    const child = node(serveScript(port), { [LAUNCH_ID_ENV]: 'mine' });
    const outcome = await awaitOwnHealth(
      child,
      { pid: child.pid!, launchId: 'mine' },
      `http://127.0.0.1:${port}/health`,
      NEVER_MS,
    );
    expect(outcome).toEqual({
      kind: 'exited',
      exit: 'exit code 1',
      answeredBy: `another process (pid ${process.pid}, resources 'old')`,
    });
  });

  test('a child that dies on a port a silent socket holds ends the wait at its exit', async () => {
    // Accepts connections and never answers: a health request to it would wait forever.
    const silent = createNetServer(() => undefined);
    servers.push(silent);
    await new Promise<void>((done) => silent.listen(0, '127.0.0.1', done));
    const { port } = silent.address() as AddressInfo;
    const child = node(serveScript(port), { [LAUNCH_ID_ENV]: 'mine' });
    const outcome = await awaitOwnHealth(
      child,
      { pid: child.pid!, launchId: 'mine' },
      `http://127.0.0.1:${port}/health`,
      NEVER_MS,
    );
    expect(outcome).toEqual({ kind: 'exited', exit: 'exit code 1' });
  });

  test('a child that lives but never answers times out, naming who answers instead', async () => {
    const port = await foreignHealth({ status: 'ok', pid: 1, launch_id: null });
    const child = node('setInterval(() => undefined, 1000)');
    const outcome = await awaitOwnHealth(
      child,
      { pid: child.pid!, launchId: 'mine' },
      `http://127.0.0.1:${port}/health`,
      300,
    );
    expect(outcome).toEqual({
      kind: 'timeout',
      afterMs: 300,
      answeredBy: 'another process (pid 1)',
    });
  });
});
