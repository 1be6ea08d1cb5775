import { encodeFrame, FrameError, FrameReader, MAX_FRAME_BYTES } from '../../src/workers/frames.js';
import { channelPair, useSockets } from './sockets.js';

useSockets();

const FAITHFUL = {
  logprob: -Infinity,
  score: NaN,
  high: Infinity,
  big: 2n ** 70n,
  neg: -(2n ** 64n),
};

describe('worker channel frames', () => {
  test('NaN, -Infinity, Infinity and integers beyond 2^53 survive a frame', () => {
    const [message] = new FrameReader().push(encodeFrame(FAITHFUL));
    expect(message).toEqual(FAITHFUL);
    const m = message as Record<string, unknown>;
    expect([Number.isNaN(m.score), m.logprob, typeof m.big]).toEqual([true, -Infinity, 'bigint']);
  });

  test('NaN, -Infinity and big integers survive a request and its reply over a real socket', async () => {
    const seen: unknown[] = [];
    const { a } = await channelPair({
      handler: async (_kind, body) => {
        seen.push(body);
        return { echoed: body, logprobs: [-Infinity, NaN], count: 2n ** 63n + 1n };
      },
    });
    const reply = await a.call('echo', FAITHFUL);
    expect(seen).toEqual([FAITHFUL]);
    expect(reply).toEqual({ echoed: FAITHFUL, logprobs: [-Infinity, NaN], count: 2n ** 63n + 1n });
  });

  test('a frame split across chunks and frames sharing a chunk are read whole', () => {
    const one = encodeFrame({ a: 1 });
    const two = encodeFrame({ b: 'x'.repeat(1000) });
    const bytes = Buffer.concat([one, two]);
    const reader = new FrameReader();
    const out = [];
    for (let i = 0; i < bytes.length; i += 3) out.push(...reader.push(bytes.subarray(i, i + 3)));
    expect(out).toEqual([{ a: 1 }, { b: 'x'.repeat(1000) }]);
  });

  test('a length prefix beyond the 1 GiB limit is rejected as corrupt', () => {
    const prefix = Buffer.alloc(4);
    prefix.writeUInt32BE(MAX_FRAME_BYTES + 1, 0);
    expect(() => new FrameReader().push(prefix)).toThrow(FrameError);
    const atLimit = Buffer.alloc(4);
    atLimit.writeUInt32BE(MAX_FRAME_BYTES, 0);
    // At the limit it is a (long) frame still being read, not an error.
    expect(new FrameReader().push(atLimit)).toEqual([]);
  });

  test('a message longer than the limit cannot be framed', () => {
    expect(() => encodeFrame({ text: 'x'.repeat(100) }, 50)).toThrow(FrameError);
  });
});
