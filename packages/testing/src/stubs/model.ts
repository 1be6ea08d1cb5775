/**
 * What an agent talks to, as stubs: a scripted Responses API model (one `get_weather` function
 * call, then a final message) that can hold its next reply, and a resources server whose tools
 * record the path, prefix and cookies each call carried. `await using` closes either.
 */
import express, { type Request } from 'express';

import { Gate } from '@ckpt-gym/core/testing';
import { serve } from '../serve.js';

export interface RecordedCall {
  /** The capture key of the call's `/ng-rollout/<key>` prefix, or null. */
  key: string | null;
  path: string;
  body: Record<string, unknown>;
  cookie: string | undefined;
  headers: Record<string, string | string[] | undefined>;
}

function splitPrefix(req: Request): { key: string | null; path: string } {
  const m = /^\/ng-rollout\/([^/]+)(\/.*)$/.exec(req.path);
  return m ? { key: m[1]!, path: m[2]! } : { key: null, path: req.path };
}

/** What a stub records of each call. */
function recorded(req: Request): RecordedCall {
  const { key, path } = splitPrefix(req);
  return {
    key,
    path,
    body: req.body as Record<string, unknown>,
    cookie: req.headers.cookie,
    headers: req.headers,
  };
}

interface Held {
  gate: Gate;
  arrived: () => void;
  sent: () => void;
}

/** The next call a stub holds: the test opens its gate; `arrived` and `sent` say how far it got. */
class NextHold {
  #held: Held | null = null;

  hold(): { gate: Gate; arrived: Promise<void>; sent: Promise<void> } {
    const held: Partial<Held> = { gate: new Gate() };
    const arrived = new Promise<void>((r) => (held.arrived = r));
    const sent = new Promise<void>((r) => (held.sent = r));
    this.#held = held as Held;
    return { gate: this.#held.gate, arrived, sent };
  }

  /** The hold for the call that just came in, if the test asked for one (once). */
  take(): Held | null {
    const held = this.#held;
    this.#held = null;
    return held;
  }
}

/** Resolves once `predicate` holds, checking whenever `notify` is called. */
class Waiters {
  private readonly waiting: { check: () => boolean; resolve: () => void }[] = [];
  until(check: () => boolean): Promise<void> {
    if (check()) return Promise.resolve();
    return new Promise((resolve) => this.waiting.push({ check, resolve }));
  }
  notify(): void {
    for (const w of [...this.waiting]) {
      if (w.check()) {
        this.waiting.splice(this.waiting.indexOf(w), 1);
        w.resolve();
      }
    }
  }
}

/** A Responses API reply with `output`. */
export function responseWith(output: unknown[]): Record<string, unknown> {
  return {
    id: 'resp',
    created_at: 0,
    model: 'm',
    object: 'response',
    output,
    parallel_tool_calls: false,
    tool_choice: 'auto',
    tools: [],
    usage: { input_tokens: 3, output_tokens: 2, total_tokens: 5 },
  };
}

export interface StubModel extends AsyncDisposable {
  readonly url: string;
  readonly calls: RecordedCall[];
  /** Holds the next model call's reply until the returned gate opens; `arrived` resolves when it came in. */
  holdNext(): { gate: Gate; arrived: Promise<void>; sent: Promise<void> };
  untilCalls(n: number): Promise<void>;
  close(): Promise<void>;
}

/** The scripted model: a question without tool output gets a `get_weather` call, one with it an answer. */
export async function startStubModel(): Promise<StubModel> {
  const calls: RecordedCall[] = [];
  const waiters = new Waiters();
  const next = new NextHold();
  const app = express();
  app.use(express.json({ limit: '64mb' }));
  app.post(/.*\/v1\/responses$/, async (req, res) => {
    calls.push(recorded(req));
    waiters.notify();
    const held = next.take();
    if (held) {
      held.arrived();
      await held.gate.promise;
      res.once('finish', held.sent);
    }
    const input = (req.body as { input: unknown }).input;
    const items = Array.isArray(input) ? (input as { type?: string }[]) : [];
    const answered = items.some((i) => i.type === 'function_call_output');
    res.json(
      responseWith(
        answered
          ? [
              {
                id: 'msg',
                type: 'message',
                role: 'assistant',
                status: 'completed',
                content: [{ type: 'output_text', text: 'It is sunny.', annotations: [] }],
              },
            ]
          : [
              {
                type: 'function_call',
                call_id: `call_${calls.length}`,
                name: 'get_weather',
                arguments: '{"city":"SF"}',
              },
            ],
      ),
    );
  });
  const server = await serve(app);
  return {
    url: server.url,
    calls,
    holdNext: () => next.hold(),
    untilCalls: (n) => waiters.until(() => calls.length >= n),
    close: () => server.close(),
    [Symbol.asyncDispose]: () => server[Symbol.asyncDispose](),
  };
}

export interface StubToolResources extends AsyncDisposable {
  readonly url: string;
  readonly calls: RecordedCall[];
  /** Holds the next tool call until the gate opens. */
  holdNext(): { gate: Gate; arrived: Promise<void> };
  close(): Promise<void>;
}

/** Tools `get_weather`, `seed_session`, `verify` and `close_session`, each call recorded. */
export async function startStubToolResources(
  options: { verifyMode?: 'wait' | 'replay' } = {},
): Promise<StubToolResources> {
  const calls: RecordedCall[] = [];
  const next = new NextHold();
  const app = express();
  app.use(express.json({ limit: '64mb' }));
  app.post(/.*/, async (req, res) => {
    const call = recorded(req);
    const { key, path } = call;
    calls.push(call);
    const held = next.take();
    if (held) {
      held.arrived();
      await held.gate.promise;
    }
    if (path === '/get_weather') {
      res.cookie('res_session', 'r1', { path: '/' });
      res.json({ city: (req.body as { city?: string }).city ?? null, weather: 'sunny' });
      return;
    }
    if (path === '/seed_session') {
      res.cookie('res_session', `seeded-${key ?? 'none'}`, { path: '/' });
      if (options.verifyMode) res.setHeader('x-ng-checkpoint-verify', options.verifyMode);
      res.json({});
      return;
    }
    if (path === '/verify') {
      res.json({ ...(req.body as object), reward: 1 });
      return;
    }
    if (path === '/close_session') {
      res.json({});
      return;
    }
    res.status(404).json({ error: { code: 'not_found', detail: path } });
  });
  const server = await serve(app);
  return {
    url: server.url,
    calls,
    holdNext: () => next.hold(),
    close: () => server.close(),
    [Symbol.asyncDispose]: () => server[Symbol.asyncDispose](),
  };
}
