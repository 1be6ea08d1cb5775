/**
 * The fake inference backend: OpenAI chat completions answered from a script, with control
 * routes under `/_ctl/` that hold, gate and step calls and show what the backend saw.
 */
import { once } from 'node:events';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';

import {
  CaptureValidationError,
  type CommitCoords,
  GENERATION_CUT_ROUTE,
  verifyAndLinearize,
} from '@ckpt-gym/core/capture';
import { ConfigError, InvalidRequestError, rolloutPrefixMiddleware } from '@ckpt-gym/core/protocol';
import {
  healthReply,
  type ErrorLogger,
  answerParserErrorsAsJson,
  errorMiddleware,
  jsonBody,
  keepIdleConnections,
  LISTEN_BACKLOG,
  gymRoute,
  mountRoutes,
  notFoundMiddleware,
  type RequestContext,
} from '@ckpt-gym/core/server';
import { REQUEST_ID_HEADER } from '@ckpt-gym/core/client';
import express, { type Express, type Response } from 'express';

import { type CallRecord, CallLog, TokenStore, completionTokens, promptTokens } from './calls.js';
import {
  type CapturedCall,
  captureFailedCoords,
  cutRound,
  finishCapture,
  generate,
  generateRest,
  openCapture,
} from './capture.js';
import {
  WaitQueue,
  objectBody,
  parseGateBody,
  parseHoldBody,
  parseKeepAliveBody,
  parseReleaseBody,
  parseStepBody,
} from './holds.js';
import {
  type ChatRequest,
  type CompletionMeta,
  completionBody,
  completionChunks,
  modelList,
  parseChatRequest,
  usage,
} from './openai.js';
import {
  type ChatMessage,
  SCRIPTS,
  type Script,
  type ScriptName,
  ScriptBook,
  parseScript,
  scriptedReply,
} from './script.js';

export const DEFAULT_MODEL = 'fake-model';
const BODY_LIMIT = '50mb';
/** The name `/health` gives when none is set (a backend run by itself, outside a stack file). */
export const DEFAULT_SERVER_NAME = 'fake-inference';

export interface FakeInferenceOptions {
  /** The server's name in the stack file, as `/health` reports it. */
  readonly name?: string;
  /** The model `/v1/models` lists and replies name when the request names none. */
  readonly model?: string;
  /** The default script; `weather` unless set. */
  readonly script?: ScriptName | Script;
  /** Interval of `: keep-alive` comments on held streamed calls; 0 (the default) sends none. */
  readonly keepAliveMs?: number;
  /** Where unexpected errors are logged (clients only see `internal_error`). */
  readonly logger?: ErrorLogger;
}

export interface FakeInferenceState {
  readonly model: string;
  readonly calls: CallLog;
  readonly tokens: TokenStore;
  readonly queue: WaitQueue;
  readonly scripts: ScriptBook;
  /** Captured calls in flight, by model call id: what a generation cut snapshots. */
  readonly active: Map<string, CapturedCall>;
  keepAliveMs: number;
}

const SSE_HEADERS = {
  'content-type': 'text/event-stream',
  'cache-control': 'no-cache',
  connection: 'keep-alive',
};

function startStream(res: Response): void {
  if (!res.headersSent) res.writeHead(200, SSE_HEADERS);
}

/**
 * Sends `: keep-alive` comments while a streamed call waits, which also sends the status line and
 * headers before any data chunk (what a proxy must not mistake for the start of a response).
 */
function keepAliveWhileWaiting(res: Response, intervalMs: number): () => void {
  if (intervalMs <= 0) return () => undefined;
  const timer = setInterval(() => {
    startStream(res);
    res.write(': keep-alive\n\n');
  }, intervalMs);
  return () => clearInterval(timer);
}

async function chatCompletion(
  state: FakeInferenceState,
  { req, res, body: request, episode, signal }: RequestContext<ChatRequest>,
): Promise<void> {
  const requestId = req.headers[REQUEST_ID_HEADER];
  const { record, rolloutCallIndex } = state.calls.admit({
    episode,
    n_messages: request.messages.length,
    admission: request.admission,
    stream: request.stream,
    ...(typeof requestId === 'string' ? { request_id: requestId } : {}),
  });
  res.on('finish', () => {
    record.returned = true;
  });
  res.on('close', () => {
    if (!res.writableFinished) record.dropped = true;
  });

  // The answer is fixed at arrival: a script changed while the call waits does not change it.
  const reply = scriptedReply(state.scripts.scriptFor(episode), request.messages, record.index);
  const tokens = {
    prompt_token_ids: promptTokens(request.messages),
    completion_token_ids: completionTokens(reply),
  };
  state.tokens.put(record.index, tokens);
  const capture = openCaptureFor(
    state,
    record,
    request.admission,
    request.messages,
    tokens.completion_token_ids,
  );

  const reason = state.queue.reasonFor({ index: record.index, rolloutCallIndex });
  if (reason) {
    record.held = true;
    // A held call is in flight: it generates `after_tokens` tokens, then waits, and a
    // generation cut arriving meanwhile snapshots what it generated so far.
    const id = capture?.live.admission.model_call_id;
    if (capture && id !== undefined) {
      generate(capture, state.queue.hold.after_tokens);
      state.active.set(id, capture);
    }
    const stopKeepAlive = request.stream
      ? keepAliveWhileWaiting(res, state.keepAliveMs)
      : () => undefined;
    const released = await state.queue.wait(reason, signal);
    stopKeepAlive();
    if (id !== undefined && state.active.get(id) === capture) state.active.delete(id);
    if (!released) return;
  }
  const coords = capture
    ? completeCaptured(state, record, capture, request.admission)
    : request.admission !== null
      ? captureFailedCoords(request.admission, record.capture_key ?? undefined)
      : undefined;

  const meta: CompletionMeta = {
    id: `chatcmpl-${record.index}`,
    created: Math.floor(Date.now() / 1000),
    model: request.model ?? state.model,
  };
  const use = usage(tokens.prompt_token_ids.length, tokens.completion_token_ids.length);
  const extra = coords ? { ng_commit_coords: coords } : {};
  if (!request.stream) {
    res.json({ ...completionBody(meta, reply, use), ...extra });
    return;
  }
  startStream(res);
  // The whole answer is generated before its first chunk, so the coordinates ride that chunk.
  completionChunks(meta, reply, use, request.includeUsage).forEach((chunk, i) => {
    res.write(`data: ${JSON.stringify(i === 0 ? { ...chunk, ...extra } : chunk)}\n\n`);
  });
  res.end('data: [DONE]\n\n');
}

/** Opens capture for a call with an admission; a refusal is recorded and the call is not staged. */
function openCaptureFor(
  state: FakeInferenceState,
  record: CallRecord,
  admission: unknown,
  messages: readonly ChatMessage[],
  answer: readonly number[],
): CapturedCall | undefined {
  if (admission === null) return undefined;
  try {
    const capture = openCapture(state.tokens, admission, messages, answer);
    if (capture.live.cut) {
      record.continued_from = capture.live.cut.continuation.source_model_call_id;
      record.reused_prefix_tokens = capture.reused;
    }
    return capture;
  } catch (err) {
    if (!(err instanceof CaptureValidationError)) throw err;
    record.capture_error = err.reason;
    return undefined;
  }
}

function completeCaptured(
  state: FakeInferenceState,
  record: CallRecord,
  capture: CapturedCall,
  admission: unknown,
): CommitCoords | undefined {
  generateRest(capture);
  try {
    return finishCapture(state.tokens, capture);
  } catch (err) {
    if (!(err instanceof CaptureValidationError)) throw err;
    record.capture_error = err.reason;
    return captureFailedCoords(admission, record.capture_key ?? undefined);
  }
}

/**
 * `POST /_ctl/rebuild {manifest, terminal_call_id?}`: verifies a rollout's ledger manifest (as the
 * policy model's manifest route returns it) against this store and linearizes its tokens.
 */
function rebuild(state: FakeInferenceState, body: unknown) {
  const { manifest, terminal_call_id: terminal } = objectBody(body, '/_ctl/rebuild', [
    'manifest',
    'terminal_call_id',
  ]);
  const m = manifest as { rollout_id?: unknown; records?: unknown } | null;
  if (typeof m?.rollout_id !== 'string' || !Array.isArray(m.records)) {
    throw new InvalidRequestError('manifest: must be {rollout_id, records: [...]}');
  }
  if (terminal !== undefined && typeof terminal !== 'string') {
    throw new InvalidRequestError('terminal_call_id: must be a string');
  }
  return verifyAndLinearize(
    { rollout_id: m.rollout_id, records: m.records as Record<string, unknown>[] },
    (key) => state.tokens.stagedRecord(key),
    terminal,
  );
}

function setScript(state: FakeInferenceState, body: unknown): string | null {
  const { script, rollout } = objectBody(body, '/_ctl/script', ['script', 'rollout']);
  const parsed = parseScript(script);
  if (rollout === undefined || rollout === null) {
    state.scripts.setDefault(parsed);
    return null;
  }
  if (typeof rollout !== 'string')
    throw new InvalidRequestError('rollout: must be a capture key or rollout id');
  state.scripts.setFor(rollout, parsed);
  return rollout;
}

function controlRoutes(state: FakeInferenceState): express.Router {
  const router = express.Router();
  const { queue } = state;
  router.post('/hold', (req, res) => {
    queue.setHold(parseHoldBody(req.body));
    res.json({ ok: true, hold: queue.hold });
  });
  router.post('/release', (req, res) => {
    parseReleaseBody(req.body);
    res.json({ ok: true, released: queue.releaseAll() });
  });
  router.post('/gate', (req, res) => {
    const closed = parseGateBody(req.body);
    res.json({ ok: true, closed, released: queue.setGate(closed) });
  });
  router.post('/step', (req, res) => {
    const released = queue.step(parseStepBody(req.body));
    res.json({ ok: true, released, waiting: queue.waiting });
  });
  router.post('/script', (req, res) => {
    res.json({ ok: true, rollout: setScript(state, req.body) });
  });
  router.post('/keepalive', (req, res) => {
    state.keepAliveMs = parseKeepAliveBody(req.body);
    res.json({ ok: true, interval_ms: state.keepAliveMs });
  });
  router.get('/calls', (_req, res) => {
    res.json({ calls: state.calls.list() });
  });
  router.get('/call_count', (_req, res) => {
    res.json({ count: state.calls.count, waiting: queue.waiting });
  });
  router.get('/cuts', (_req, res) => {
    res.json({ cuts: state.tokens.cutRounds() });
  });
  router.post('/rebuild', (req, res) => {
    res.json(rebuild(state, req.body));
  });
  return router;
}

export function createFakeInferenceApp(options: FakeInferenceOptions = {}): {
  app: Express;
  state: FakeInferenceState;
} {
  const tokens = new TokenStore();
  const keepAliveMs = options.keepAliveMs ?? 0;
  if (!Number.isSafeInteger(keepAliveMs) || keepAliveMs < 0) {
    throw new ConfigError(`keepAliveMs must be a non-negative integer, got ${keepAliveMs}`);
  }
  const state: FakeInferenceState = {
    model: options.model ?? DEFAULT_MODEL,
    calls: new CallLog(tokens),
    tokens,
    queue: new WaitQueue(),
    active: new Map(),
    scripts: new ScriptBook(
      typeof options.script === 'string'
        ? SCRIPTS[options.script]
        : (options.script ?? SCRIPTS.weather),
    ),
    keepAliveMs,
  };

  const app = express();
  app.disable('x-powered-by');
  // The gym servers' health reply: a launcher checks its pid and launch id, not just the status.
  const health = healthReply(options.name ?? DEFAULT_SERVER_NAME, 'inference');
  app.get('/health', (_req, res) => {
    res.json(health);
  });
  app.use(rolloutPrefixMiddleware());
  mountRoutes(app, [
    gymRoute({
      method: 'get',
      path: '/v1/models',
      episode: 'none',
      run: () => modelList(state.model),
    }),
    gymRoute({
      method: 'post',
      path: '/v1/chat/completions',
      episode: 'optional',
      body: { limit: BODY_LIMIT, parse: parseChatRequest },
      run: (ctx) => chatCompletion(state, ctx),
      reply: 'streamed',
    }),
    gymRoute({
      method: 'post',
      path: GENERATION_CUT_ROUTE,
      episode: 'none',
      body: { limit: BODY_LIMIT, parse: (body) => body },
      run: ({ body }) => cutRound(state.tokens, state.active, body),
    }),
  ]);
  // The test-control routes (hold, gate, step, script, ...) read plain JSON bodies.
  app.use('/_ctl', jsonBody(BODY_LIMIT), controlRoutes(state));
  app.use(notFoundMiddleware());
  app.use(errorMiddleware(options.logger));
  return { app, state };
}

export interface ListenOptions extends FakeInferenceOptions {
  /** 0 (the default) picks a free port. */
  readonly port?: number;
  /** Default 127.0.0.1. */
  readonly host?: string;
}

export interface RunningFakeInference {
  readonly app: Express;
  readonly server: Server;
  readonly state: FakeInferenceState;
  readonly port: number;
  readonly host: string;
  /** `http://host:port`; the OpenAI base URL is this plus `/v1`. */
  readonly url: string;
  /** Stops listening and drops open connections, held calls included. */
  close(): Promise<void>;
}

export async function startFakeInference(
  options: ListenOptions = {},
): Promise<RunningFakeInference> {
  const { app, state } = createFakeInferenceApp(options);
  const host = options.host ?? '127.0.0.1';
  const server = createServer(app);
  keepIdleConnections(server);
  answerParserErrorsAsJson(server);
  server.listen({ port: options.port ?? 0, host, backlog: LISTEN_BACKLOG });
  await once(server, 'listening');
  const { port } = server.address() as AddressInfo;
  const urlHost = host.includes(':') ? `[${host}]` : host;
  return {
    app,
    server,
    state,
    port,
    host,
    url: `http://${urlHost}:${port}`,
    close: () =>
      new Promise<void>((resolve, reject) => {
        server.close((err) => (err ? reject(err) : resolve()));
        server.closeAllConnections();
      }),
  };
}
