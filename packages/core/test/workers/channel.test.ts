import { CkptGymError, StaleAttemptError } from '../../src/errors.js';
import { Channel } from '../../src/workers/channel.js';
import { encodeFrame, FrameReader, WithBytes } from '../../src/workers/frames.js';
import { MemoryLogger } from '../support/test-participant.js';
import { channelPair, refusedWith, socketPair, useSockets } from './sockets.js';

useSockets();

/** The code and status of the typed error a promise rejects with. */
async function refusal(p: Promise<unknown>): Promise<[string, number]> {
  const err = await refusedWith(p);
  return [err.code, err.status];
}

describe('the worker channel', () => {
  test('a reply that cannot be framed is answered with a typed 422 invalid_checkpoint_state, not a hang', async () => {
    const logger = new MemoryLogger();
    const { a } = await channelPair({
      logger,
      handler: async () => ({ when: new Date() }) as never,
    });
    // A long timeout: the typed reply, not the timeout, must end the call.
    await expect(refusal(a.call('export', {}, 60_000))).resolves.toEqual([
      'invalid_checkpoint_state',
      422,
    ]);
    expect(logger.lines.map((l) => l.message)).toContain('checkpoint reply cannot be framed');
  });

  test('a reply longer than the frame limit is a typed 422 error too', async () => {
    const { a } = await channelPair({
      maxFrameBytes: 200,
      handler: async () => ({ text: 'x'.repeat(1000) }),
    });
    await expect(refusal(a.call('export', {}, 60_000))).resolves.toEqual([
      'invalid_checkpoint_state',
      422,
    ]);
  });

  test('no reply within the timeout is a retryable 503 checkpoint_coordinator_unavailable', async () => {
    const { a } = await channelPair({ handler: () => new Promise(() => {}) });
    await expect(refusal(a.call('claim', {}, 100))).resolves.toEqual([
      'checkpoint_coordinator_unavailable',
      503,
    ]);
  });

  test('a connection lost while a call waits fails it with checkpoint_coordinator_unavailable', async () => {
    const { a, b } = await channelPair({ handler: () => new Promise(() => {}) });
    const call = refusal(a.call('close', {}, 60_000));
    setTimeout(() => b.destroy(), 20);
    await expect(call).resolves.toEqual(['checkpoint_coordinator_unavailable', 503]);
    await expect(refusal(a.call('open', {}))).resolves.toEqual([
      'checkpoint_coordinator_unavailable',
      503,
    ]);
  });

  test("a handler's typed error reaches the caller with its code; an untyped throw is checkpoint_error", async () => {
    const { a } = await channelPair({
      handler: async (kind) => {
        if (kind === 'typed') throw new StaleAttemptError('attempt r1#0 was retired');
        throw new Error('boom');
      },
    });
    const typed = await a.call('typed', {}).catch((e: unknown) => e);
    expect(typed).toBeInstanceOf(CkptGymError);
    expect([(typed as CkptGymError).code, (typed as CkptGymError).detail]).toEqual([
      'stale_attempt',
      'attempt r1#0 was retired',
    ]);
    await expect(refusal(a.call('untyped', {}))).resolves.toEqual(['checkpoint_error', 409]);
  });

  test('an immediate reply is written before any message the other end sends after it', async () => {
    const [raw, served] = await socketPair();
    // The coordinator's side: a claim is answered at once, and the same tick starts a close.
    const b: Channel = new Channel(served, {
      handler: async () => ({}),
      immediate: (kind) => {
        if (kind !== 'claim') return undefined;
        queueMicrotask(() => void b.call('close', {}).catch(() => {}));
        return { claimed: true };
      },
    });
    const frames: unknown[] = [];
    const reader = new FrameReader();
    const two = new Promise<void>((resolve) => {
      raw.on('data', (chunk: Buffer) => {
        frames.push(...reader.push(chunk));
        if (frames.length >= 2) resolve();
      });
    });
    raw.write(encodeFrame({ id: 1, kind: 'claim', body: {} }));
    await two;
    expect(
      frames.map((f) =>
        'reply_to' in (f as object) ? 'claim reply' : (f as { kind: string }).kind,
      ),
    ).toEqual(['claim reply', 'close']);
  });

  test('a corrupt length prefix drops the connection and fails the waiting calls', async () => {
    const [s1, s2] = await socketPair();
    const a = new Channel(s1, { handler: () => new Promise(() => {}) });
    const call = refusal(a.call('close', {}, 60_000));
    const bad = Buffer.alloc(4);
    bad.writeUInt32BE(0xffffffff, 0);
    s2.write(bad);
    await expect(call).resolves.toEqual(['checkpoint_coordinator_unavailable', 503]);
  });

  test('a reply with bytes reaches the caller as its body and the bytes unencoded, over a real socket', async () => {
    const bytes = Buffer.from([0xff, 0xfe, 0x00, 0x7b]);
    const { a } = await channelPair({
      handler: async () => new WithBytes({ logprob: -Infinity, big: 2n ** 64n }, bytes),
    });
    const reply = await a.call('snapshot', {});
    expect(reply).toBeInstanceOf(WithBytes);
    expect((reply as WithBytes).body).toEqual({ logprob: -Infinity, big: 2n ** 64n });
    expect(Buffer.from((reply as WithBytes).bytes)).toEqual(bytes);
    // A plain reply is still the body itself.
    const { a: plain } = await channelPair({ handler: async () => ({ ok: 1 }) });
    await expect(plain.call('x', {})).resolves.toEqual({ ok: 1 });
  });

  test('a reply whose bytes take it over the frame limit is a typed 422, not a hang', async () => {
    const { a } = await channelPair({
      maxFrameBytes: 200,
      handler: async () => new WithBytes({}, Buffer.alloc(1000)),
    });
    await expect(refusal(a.call('snapshot', {}, 60_000))).resolves.toEqual([
      'invalid_checkpoint_state',
      422,
    ]);
  });

  test('a request with bytes reaches its handler with its body and the bytes unencoded, over a real socket', async () => {
    const bytes = Buffer.from([0xff, 0xfe, 0x00, 0x7b]);
    const seen: { body: unknown; bytes: Buffer | undefined }[] = [];
    const { a } = await channelPair({
      handler: async (_kind, body, received) => {
        seen.push({ body, bytes: received && Buffer.from(received) });
        return { ok: 1 };
      },
    });
    await expect(a.call('install', new WithBytes({ big: 2n ** 64n }, bytes))).resolves.toEqual({
      ok: 1,
    });
    await a.call('close', {});
    expect(seen).toEqual([
      { body: { big: 2n ** 64n }, bytes },
      { body: {}, bytes: undefined },
    ]);
  });

  test('a request whose bytes take it over the frame limit fails at once with a typed 422', async () => {
    const { a } = await channelPair({ maxFrameBytes: 200, handler: async () => ({}) });
    await expect(
      refusal(a.call('install', new WithBytes({}, Buffer.alloc(1000)), 60_000)),
    ).resolves.toEqual(['invalid_checkpoint_state', 422]);
  });
});
