/**
 * Stub agent and resources servers as an environment sees them: they speak the wire shapes
 * single_agent_turn calls, record every call (path without prefix, the prefix's capture key,
 * headers, body), and each route can be told to hold on a gate, fail with a status, drop the
 * connection or add reply headers. `await using` stops them.
 */
import { type Server } from 'node:http';
import type { AddressInfo } from 'node:net';

import express, { type Request, type Response } from 'express';

import type { Gate } from '@ckpt-gym/core/testing';

/** Orders calls across every stub server of a test. */
let sequence = 0;

export interface Call {
  /** Global arrival order across stub servers. */
  seq: number;
  path: string;
  /** The capture key of the `/ng-rollout/<key>` prefix, or null without one. */
  key: string | null;
  headers: Record<string, string | string[] | undefined>;
  body: Record<string, unknown>;
  /** The reply was written out in full. */
  finished: boolean;
}

export interface Behaviour {
  /** Hold the reply until the gate opens. */
  gate?: Gate;
  /** Reply with this status and an error body instead. */
  status?: number;
  /** The error body's code (default `stub`, no catalogue code). */
  code?: string;
  /** Destroy the connection without replying. */
  destroy?: boolean;
  headers?: Record<string, string>;
  /** Merged into the normal reply body. */
  body?: Record<string, unknown>;
  /** Reply exactly this body, without the route's handler (so no cookie either). */
  plain?: Record<string, unknown>;
}

type Handler = (call: Call, req: Request, res: Response) => Record<string, unknown>;

const PREFIX = /^\/ng-rollout\/([^/]+)(\/.*)$/;

export class StubServer implements AsyncDisposable {
  readonly calls: Call[] = [];
  private readonly behaviours = new Map<string, Behaviour>();
  private readonly waiters: { path: string; count: number; resolve: () => void }[] = [];
  private server: Server | undefined;
  url = '';

  constructor(private readonly routes: Record<string, Handler>) {}

  /** Sets how `path` behaves from now on (replaces the earlier behaviour). */
  on(path: string, behaviour: Behaviour): void {
    this.behaviours.set(path, behaviour);
  }

  paths(): string[] {
    return this.calls.map((c) => c.path);
  }

  count(path: string): number {
    return this.calls.filter((c) => c.path === path).length;
  }

  /** Resolves once `count` calls to `path` have arrived. */
  arrived(path: string, count = 1): Promise<void> {
    if (this.count(path) >= count) return Promise.resolve();
    return new Promise((resolve) => this.waiters.push({ path, count, resolve }));
  }

  async start(): Promise<void> {
    const app = express();
    app.use(express.json({ limit: '64mb' }));
    app.post(/.*/, async (req, res) => {
      const match = PREFIX.exec(req.path);
      const path = match ? match[2]! : req.path;
      sequence += 1;
      const call: Call = {
        seq: sequence,
        path,
        key: match ? decodeURIComponent(match[1]!) : null,
        headers: req.headers,
        body: req.body as Record<string, unknown>,
        finished: false,
      };
      res.on('finish', () => {
        call.finished = true;
      });
      this.calls.push(call);
      for (const w of [...this.waiters]) {
        if (w.path === path && this.count(path) >= w.count) {
          this.waiters.splice(this.waiters.indexOf(w), 1);
          w.resolve();
        }
      }
      const behaviour = this.behaviours.get(path) ?? {};
      if (behaviour.gate) await behaviour.gate.promise;
      if (behaviour.destroy) {
        req.socket.destroy();
        return;
      }
      for (const [name, value] of Object.entries(behaviour.headers ?? {}))
        res.setHeader(name, value);
      if (behaviour.status !== undefined) {
        res
          .status(behaviour.status)
          .json({ error: { code: behaviour.code ?? 'stub', detail: 'stub failure' } });
        return;
      }
      if (behaviour.plain) {
        res.json(behaviour.plain);
        return;
      }
      const handler = this.routes[path];
      if (!handler) {
        res.status(404).json({ error: { code: 'not_found', detail: path } });
        return;
      }
      res.json({ ...handler(call, req, res), ...behaviour.body });
    });
    await new Promise<void>((resolve) => {
      this.server = app.listen(0, '127.0.0.1', () => resolve());
    });
    this.url = `http://127.0.0.1:${(this.server!.address() as AddressInfo).port}`;
  }

  async stop(): Promise<void> {
    const server = this.server;
    if (!server) return;
    server.closeAllConnections();
    await new Promise<void>((resolve) => server.close(() => resolve()));
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.stop();
  }
}

export const AGENT_RESPONSE = {
  id: 'resp_1',
  object: 'response',
  output: [
    { type: 'message', role: 'assistant', content: [{ type: 'output_text', text: 'Paris' }] },
  ],
};

export const OBSERVATIONS = { invocations: [{ id: 'root', items: 3 }] };

/** Resources: seed sets a `session` cookie; verify replies reward 1.0; close echoes the id. */
export function stubResources(): StubServer {
  return new StubServer({
    '/seed_session': (call, _req, res) => {
      res.cookie('session', `s-${String(call.body.resources_session_id)}`);
      return { resources_session_id: call.body.resources_session_id };
    },
    '/verify': (call) => ({ reward: 1.0, response: call.body.response }),
    '/close_session': (call) => ({ resources_session_id: call.body.resources_session_id }),
    '/aggregate_metrics': (call) => ({
      count: ((call.body.verify_responses as unknown[] | undefined) ?? []).length,
    }),
  });
}

/** Agent: seed sets the `agent_session_id` cookie; activation replies AGENT_RESPONSE; close observes. */
export function stubAgent(): StubServer {
  return new StubServer({
    '/v1/agent_sessions': (call, _req, res) => {
      res.cookie('agent_session_id', String(call.body.agent_session_id));
      return { agent_session_id: call.body.agent_session_id };
    },
    '/v1/responses': () => ({ ...AGENT_RESPONSE }),
    '/v1/agent_sessions/close': (call) => ({
      agent_session_id: call.body.agent_session_id,
      agent_observations: OBSERVATIONS,
      resources_cookies: null,
    }),
  });
}
