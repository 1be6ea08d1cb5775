import {
  encodeFrame,
  framePieces,
  FrameError,
  FrameReader,
  MAX_FRAME_BYTES,
  WithBytes,
} from '../../src/workers/frames.js';
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

  test('a frame with bytes is written as pieces: the bytes themselves, not a copy in a fresh frame', () => {
    const bytes = Buffer.from('x'.repeat(1000));
    const pieces = framePieces(FAITHFUL, MAX_FRAME_BYTES, bytes);
    expect(pieces[pieces.length - 1]).toBe(bytes);
    expect(Buffer.concat(pieces)).toEqual(encodeFrame(FAITHFUL, MAX_FRAME_BYTES, bytes));
    expect(new FrameReader().push(Buffer.concat(pieces))).toEqual([new WithBytes(FAITHFUL, bytes)]);
    expect(() => framePieces({ a: 1 }, 50, Buffer.alloc(100))).toThrow(FrameError);
  });

  test('a message longer than the limit cannot be framed', () => {
    expect(() => encodeFrame({ text: 'x'.repeat(100) }, 50)).toThrow(FrameError);
  });

  test("bytes beside a frame's JSON reach the reader as they are, also across chunks", () => {
    // Not UTF-8 and not JSON: they would not survive being encoded as text.
    const bytes = Buffer.from([0xff, 0x00, 0xfe, 0x22, 0x5c, 0x0a]);
    const frame = encodeFrame(FAITHFUL, MAX_FRAME_BYTES, bytes);
    const whole = new FrameReader().push(frame);
    expect(whole).toEqual([new WithBytes(FAITHFUL, bytes)]);
    const reader = new FrameReader();
    const out = [];
    const stream = Buffer.concat([frame, encodeFrame({ after: true })]);
    for (let i = 0; i < stream.length; i += 5) out.push(...reader.push(stream.subarray(i, i + 5)));
    expect(out).toHaveLength(2);
    expect(out[0]).toBeInstanceOf(WithBytes);
    expect(Buffer.from((out[0] as WithBytes).bytes)).toEqual(bytes);
    expect((out[0] as WithBytes).body).toEqual(FAITHFUL);
    expect(out[1]).toEqual({ after: true });
  });

  test('a frame with no bytes beside its JSON is read as a frame with empty bytes', () => {
    const [message] = new FrameReader().push(
      encodeFrame({ a: 1 }, MAX_FRAME_BYTES, Buffer.alloc(0)),
    );
    expect(message).toBeInstanceOf(WithBytes);
    expect((message as WithBytes).bytes.length).toBe(0);
  });

  test('a frame whose JSON length runs past the frame is rejected as corrupt', () => {
    // A well-formed JSON text fills the frame, but the length it declares is 10 bytes more.
    const json = Buffer.from('{"a":1}');
    const frame = Buffer.alloc(8 + json.length);
    frame.writeUInt32BE((0x8000_0000 | (4 + json.length)) >>> 0, 0);
    frame.writeUInt32BE(json.length + 10, 4);
    json.copy(frame, 8);
    expect(() => new FrameReader().push(frame)).toThrow(/cannot hold the JSON length/);
    expect(() => new FrameReader().push(frame)).toThrow(FrameError);
  });

  test('a frame with bytes too short to hold its JSON length is rejected as corrupt', () => {
    const frame = Buffer.alloc(6);
    frame.writeUInt32BE((0x8000_0000 | 2) >>> 0, 0);
    expect(() => new FrameReader().push(frame)).toThrow(FrameError);
  });

  test('the frame limit counts the bytes beside the JSON', () => {
    expect(() => encodeFrame({ a: 1 }, 50, Buffer.alloc(100))).toThrow(FrameError);
    expect(() => encodeFrame({ a: 1 }, 150, Buffer.alloc(100))).not.toThrow();
    // A reader with a lower limit refuses the frame as too long.
    const frame = encodeFrame({ a: 1 }, MAX_FRAME_BYTES, Buffer.alloc(100));
    expect(() => new FrameReader(50).push(frame)).toThrow(/exceeds the limit/);
  });
});
