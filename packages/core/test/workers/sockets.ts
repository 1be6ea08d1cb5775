/** Real Unix-socket pairs for the worker-layer tests, in a short temporary directory. */
import { mkdtempSync, rmSync } from 'node:fs';
import { createServer, connect, type Server, type Socket } from 'node:net';
import { join } from 'node:path';

import { CkptGymError } from '../../src/errors.js';
import { Channel, type ChannelOptions } from '../../src/workers/channel.js';

const cleanups: (() => Promise<void> | void)[] = [];

/** Call once per test file: closes every socket, server and directory after each test. */
export function useSockets(): void {
  afterEach(async () => {
    for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
  });
}

/** A fresh socket path under /tmp (short: AF_UNIX paths are ~100 bytes). */
export function socketPath(): string {
  const dir = mkdtempSync('/tmp/cgt-');
  cleanups.push(() => rmSync(dir, { recursive: true, force: true }));
  return join(dir, 's.sock');
}

/** A connected pair of sockets over a real Unix socket. */
export async function socketPair(): Promise<[Socket, Socket]> {
  const path = socketPath();
  let accepted!: (s: Socket) => void;
  const serverSide = new Promise<Socket>((resolve) => (accepted = resolve));
  const server: Server = createServer((s) => accepted(s));
  await new Promise<void>((resolve) => server.listen(path, resolve));
  const client = connect(path);
  await new Promise<void>((resolve) => client.once('connect', () => resolve()));
  const other = await serverSide;
  cleanups.push(
    () =>
      new Promise<void>((resolve) => {
        client.destroy();
        other.destroy();
        server.close(() => resolve());
      }),
  );
  return [client, other];
}

const noHandler: ChannelOptions['handler'] = (kind) =>
  Promise.reject(new Error(`unexpected ${kind}`));

/** Two channels on one real connection: `a` calls, `b` serves with `options`. */
export async function channelPair(
  options: Partial<ChannelOptions> = {},
): Promise<{ a: Channel; b: Channel }> {
  const [s1, s2] = await socketPair();
  const limit = options.maxFrameBytes === undefined ? {} : { maxFrameBytes: options.maxFrameBytes };
  const a = new Channel(s1, { handler: noHandler, peer: 'b', ...limit });
  const b = new Channel(s2, { handler: noHandler, peer: 'a', ...options });
  return { a, b };
}

export function onCleanup(cleanup: () => Promise<void> | void): void {
  cleanups.push(cleanup);
}

/** The typed error `p` rejects with; fails the test if it resolves or rejects untyped. */
export async function refusedWith(p: Promise<unknown>): Promise<CkptGymError> {
  try {
    await p;
  } catch (err) {
    if (err instanceof CkptGymError) return err;
    throw err;
  }
  throw new Error('resolved, expected a typed refusal');
}
