import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

import { ThreadedSha256 } from '../src/hash-thread.js';
import { removeTranspiled, transpileCore } from './support/transpile.js';

const sha256 = (...parts: Buffer[]) => {
  const hash = createHash('sha256');
  for (const part of parts) hash.update(part);
  return hash.digest('hex');
};

describe('ThreadedSha256', () => {
  test('the digest is the SHA-256 of every update, in the order they were made', async () => {
    const parts = [Buffer.from('first '), Buffer.alloc(3 << 20, 0x61), Buffer.from('last')];
    const hash = new ThreadedSha256();
    // Not awaited one by one: the thread's queue keeps their order.
    const updates = parts.map((part) => hash.update(Buffer.from(part)));
    await Promise.all(updates);
    expect(await hash.digest()).toBe(sha256(...parts));
    expect(await new ThreadedSha256().digest()).toBe(sha256());
  });

  test("the bytes' memory moves to the thread and comes back unchanged: nothing is copied here", async () => {
    const bytes = Buffer.allocUnsafeSlow(1 << 16).fill(7);
    const memory = bytes.buffer;
    const hash = new ThreadedSha256();
    const back = hash.update(bytes.subarray(0, 1000));
    expect(memory.byteLength).toBe(0); // detached: the thread holds it
    const returned = await back;
    expect(returned.length).toBe(1000);
    expect(returned.buffer.byteLength).toBe(1 << 16);
    expect(returned.every((byte) => byte === 7)).toBe(true);
    expect(await hash.digest()).toBe(sha256(Buffer.alloc(1000, 7)));
  });

  test('hashes open at once are kept apart', async () => {
    const a = new ThreadedSha256();
    const b = new ThreadedSha256();
    await Promise.all([a.update(Buffer.from('a')), b.update(Buffer.from('b'))]);
    await a.update(Buffer.from('A'));
    expect(await b.digest()).toBe(sha256(Buffer.from('b')));
    expect(await a.digest()).toBe(sha256(Buffer.from('aA')));
  });

  test('a process whose hashing thread was started ahead, and then hashed, still exits on its own', async () => {
    const core = await transpileCore();
    try {
      const module = pathToFileURL(join(core, 'hash-thread.js')).href;
      const script = join(core, 'start-hash-thread.mjs');
      writeFileSync(
        script,
        `import { startHashThread, ThreadedSha256 } from '${module}';
startHashThread();
if (process.argv[2] === 'hash') await new ThreadedSha256().digest();`,
      );
      for (const mode of ['idle', 'hash']) {
        const child = spawnSync(process.execPath, [script, mode], { timeout: 20_000 });
        expect({
          mode,
          status: child.status,
          signal: child.signal,
          err: child.stderr.toString(),
        }).toEqual({
          mode,
          status: 0,
          signal: null,
          err: '',
        });
      }
    } finally {
      await removeTranspiled(core);
    }
  }, 60_000);
});
