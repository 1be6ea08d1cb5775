/**
 * The OpenAI-compatible proxy: `/v1/chat/completions` (passthrough), `/v1/responses` (converted
 * to chat completions and back), `/v1/models`, each forwarded to the inference backend. Generation
 * calls pass the policy gate, and nothing of their response — status, headers, body — is written
 * before it starts: at its first chunk of answer data, after the gate delivers it and the capture
 * ledger row is published. SSE comments (keep-alives) never start a response.
 */
import { createHash } from 'node:crypto';
import { type IncomingMessage, request as httpRequest } from 'node:http';
import { request as httpsRequest } from 'node:https';

import { conversationDigest } from '@ckpt-gym/core/capture';
import {
  pooledHttpAgent,
  pooledHttpsAgent,
  requestIdHeaders,
  TCP_KEEP_ALIVE_INITIAL_DELAY_MS,
  withTraceContext,
} from '@ckpt-gym/core/client';
import {
  CkptGymError,
  InternalError,
  type JsonObject,
  captureKey,
  toClientError,
  UpstreamError,
} from '@ckpt-gym/core/protocol';
import {
  gymRoute,
  type GymRoute,
  type Logger,
  checkChatMessages,
  mountRoutes,
} from '@ckpt-gym/core/server';
import express, { type Response, type Router } from 'express';

import type { CutRecord, GenerationCuts } from './cuts.js';
import type { PolicyGate, Ticket } from './gate.js';
import type { CaptureLedger } from './ledger.js';
import {
  type CallLineage,
  captureAdmission,
  cutRestartReason,
  lineageColumns,
  resolveParent,
} from './lineage.js';
import { chatToResponse, responsesToChatRequest, ResponsesStream } from './responses.js';
import { type SseEvent, SseReader } from './sse.js';

export const GENERATION_BODY_LIMIT = '50mb';

export interface ProxyOptions {
  /** The backend's OpenAI base URL, e.g. `http://127.0.0.1:8100/v1`. */
  backendUrl: string;
  /** Forward `/ng-rollout/<key>` to the backend (the fake backend attributes calls by it). */
  forwardRolloutPrefix: boolean;
  /** Sent as `Authorization: Bearer …` to the backend when set. */
  backendApiKey?: string | undefined;
  gate: PolicyGate;
  /** The capture ledger when token capture is on. */
  ledger: CaptureLedger | undefined;
  /** Generation cuts, when on: continuations for re-issued calls, the calls a cut round sees. */
  cuts?: GenerationCuts | undefined;
  /** Runs once a call is admitted, before it is forwarded (restored attempts mark themselves started). */
  afterAdmit?: (ticket: Ticket) => Promise<void>;
  /** A restored cut the call claimed from its coordinator and did not use (several workers). */
  onUnusedCut?: (ticket: Ticket, record: CutRecord) => void;
  logger: Logger;
}

type Route = 'chat.completions' | 'responses';
type Obj = Record<string, unknown>;

/** The backend URL for `path` (relative to its `/v1` base), with the rollout prefix at the root. */
export function backendTarget(
  backendUrl: string,
  key: string | undefined,
  path: string,
  forwardPrefix: boolean,
): string {
  const url = new URL(backendUrl);
  const base = url.pathname.replace(/\/+$/, '');
  const prefix = forwardPrefix && key !== undefined ? `/ng-rollout/${encodeURIComponent(key)}` : '';
  return `${url.origin}${prefix}${base}${path}`;
}

const BACKEND_AGENT_OPTIONS = { keepAlive: true, keepAliveMsecs: TCP_KEEP_ALIVE_INITIAL_DELAY_MS };

/**
 * Calls to the backend on keep-alive agents of its own (node's http client: lighter per call than
 * fetch, and its reply streams as an async iterable of chunks). A held call sits idle for as long
 * as a checkpoint takes: its socket probes as core's data pool does (60 s, never on loopback).
 */
export class BackendClient {
  readonly #http = pooledHttpAgent(BACKEND_AGENT_OPTIONS);
  readonly #https = pooledHttpsAgent(BACKEND_AGENT_OPTIONS);

  request(
    url: string,
    init: { method: string; headers: Record<string, string>; body?: string; signal: AbortSignal },
  ): Promise<IncomingMessage> {
    const target = new URL(url);
    const secure = target.protocol === 'https:';
    return new Promise((resolve, reject) => {
      const req = (secure ? httpsRequest : httpRequest)(target, {
        method: init.method,
        // The request's id travels on to the backend (issue 21's request ids), and a real
        // backend (vLLM) joins the rollout's trace too.
        headers: withTraceContext({
          ...requestIdHeaders(),
          ...init.headers,
          ...(init.body === undefined ? {} : { 'content-length': Buffer.byteLength(init.body) }),
        }),
        agent: secure ? this.#https : this.#http,
        signal: init.signal,
      });
      req.once('response', resolve);
      req.once('error', reject);
      req.end(init.body);
    });
  }

  close(): void {
    this.#http.destroy();
    this.#https.destroy();
  }
}

async function readText(reply: IncomingMessage): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const chunk of reply) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks).toString('utf8');
}

const isOk = (reply: IncomingMessage): boolean =>
  reply.statusCode !== undefined && reply.statusCode >= 200 && reply.statusCode < 300;

/** A ledger write failed: the call is poisoned and sends no answer. */
class PoisonedCallError extends InternalError {}

/** What the first answer chunk tells the ledger row. */
export interface AnswerStart {
  responseId: string | null;
  usage: Obj | undefined;
  /** The worker's `ng_commit_coords`. */
  coords: unknown;
  /** The answer's assistant message (unknown for a streamed answer at its first chunk). */
  message: unknown;
}

/**
 * The ledger row of a delivered call (reference §3.3): custody columns from the worker's commit
 * coordinates checked against the call's admission, or a failure row (`failure_reason`) for an
 * unresolved parent or a worker that staged nothing.
 */
export function ledgerRow(
  ticket: Ticket,
  route: Route,
  requestDigest: string,
  stream: boolean,
  answer: AnswerStart,
  lineage: CallLineage,
): JsonObject {
  const num = (value: unknown): number | null => (typeof value === 'number' ? value : null);
  const row: JsonObject = {
    model_call_id: ticket.id,
    capture_key: null,
    parent_call_id: null,
    prev_len: null,
    delta_len: null,
    cum_len: null,
    weight_version: null,
    digest: null,
    extras_digest: null,
    staging_key: null,
    mode: null,
    chain_hash: null,
    cumulative_hash: null,
    response_id: answer.responseId,
    admitted_at: ticket.admittedAt,
    started_at: Date.now() / 1000,
    output_fingerprint: null,
    continuation_fingerprint: null,
    fingerprint_version: 0,
    request_digest: requestDigest,
    prompt_tokens: num(answer.usage?.prompt_tokens),
    completion_tokens: num(answer.usage?.completion_tokens),
    route,
    stream,
  };
  const { columns, failureReason } = lineageColumns(lineage, answer.coords, answer.message);
  if (failureReason !== null) row.failure_reason = failureReason;
  return { ...row, ...columns };
}

function isObj(value: unknown): value is Obj {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function parseJson(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return undefined;
  }
}

const SSE_HEADERS = {
  'content-type': 'text/event-stream; charset=utf-8',
  'cache-control': 'no-cache',
};
const JSON_HEADERS = { 'content-type': 'application/json; charset=utf-8' };

/**
 * One generation call's response writer. `start` is the only way to write the status line and
 * headers, and it first waits for the gate to deliver the response and publishes the ledger row.
 */
class HeldResponse {
  #started = false;

  constructor(
    private readonly res: Response,
    private readonly deliver: (answer: AnswerStart | undefined) => Promise<void>,
  ) {}

  get started(): boolean {
    return this.#started;
  }

  /** `answer` is set for a successful answer (it gets a ledger row), unset for an error reply. */
  async start(
    status: number,
    headers: Record<string, string>,
    answer?: AnswerStart,
  ): Promise<void> {
    await this.deliver(answer);
    this.#started = true;
    this.res.writeHead(status, headers);
  }

  write(chunk: string): void {
    this.res.write(chunk);
  }

  end(chunk?: string): void {
    this.res.end(chunk);
  }
}

export function createProxyRouter(options: ProxyOptions): Router {
  const router = express.Router();
  const backend = new BackendClient();
  mountRoutes(router, [
    modelsRoute(options, backend),
    generationRoute(options, backend, 'chat.completions'),
    generationRoute(options, backend, 'responses'),
  ]);
  return router;
}

/** `GET /v1/models`, relayed from the backend as it answers. */
function modelsRoute(options: ProxyOptions, backend: BackendClient): GymRoute {
  return gymRoute({
    method: 'get',
    path: '/v1/models',
    episode: 'optional',
    run: async ({ episode, signal }) => {
      const target = backendTarget(
        options.backendUrl,
        episode && captureKey(episode),
        '/models',
        options.forwardRolloutPrefix,
      );
      try {
        const upstream = await fromBackend(options, 'could not be reached', () =>
          backend.request(target, { method: 'GET', headers: authHeaders(options), signal }),
        );
        const text = await fromBackend(options, 'broke off its answer', () => readText(upstream));
        return { status: upstream.statusCode ?? 502, text };
      } catch (err) {
        if (!signal.aborted) warnBackendFailure(options.logger, err);
        throw err;
      }
    },
    reply: (res, { status, text }) => {
      res.status(status).type('application/json').send(text);
    },
  });
}

/**
 * A generation route: the body is checked and converted before admission (a malformed call is
 * the client's 422 and never waits), the gate admits it, `forward` answers it, and the ticket
 * leaves in the lifecycle's release, the one place it does.
 */
function generationRoute(options: ProxyOptions, backend: BackendClient, route: Route): GymRoute {
  const { gate } = options;
  return gymRoute({
    method: 'post',
    path: route === 'responses' ? '/v1/responses' : '/v1/chat/completions',
    episode: 'optional',
    body: { limit: GENERATION_BODY_LIMIT, parse: (body) => checkedGeneration(route, body) },
    admit: ({ episode, signal }) => gate.admit(episode, signal),
    release: (ticket) => releaseTicket(options, ticket),
    run: ({ body, res, signal }, ticket) => forward(options, backend, body, ticket, res, signal),
    reply: 'streamed',
  });
}

/** The ticket leaves the gate, even if giving back a claimed cut its call did not use fails. */
function releaseTicket(options: ProxyOptions, ticket: Ticket): void {
  try {
    const unused = options.cuts?.left(ticket);
    if (unused) options.onUnusedCut?.(ticket, unused);
  } finally {
    options.gate.exit(ticket);
  }
}

function authHeaders(options: ProxyOptions): Record<string, string> {
  return options.backendApiKey ? { authorization: `Bearer ${options.backendApiKey}` } : {};
}

/** A failure to reach or use the backend: a 502 naming it; the cause (socket text) is logged only. */
function upstreamError(options: ProxyOptions, what: string, cause: unknown): UpstreamError {
  const url = new URL(options.backendUrl);
  // Origin and path only: credentials or a query in the configured URL never reach a client.
  const name = `${url.origin}${url.pathname.replace(/\/+$/, '')}`;
  return new UpstreamError(`the inference backend at ${name} ${what}`, { cause });
}

/** Runs a step of talking to the backend; an untyped failure in it is the backend's (502). */
async function fromBackend<T>(
  options: ProxyOptions,
  what: string,
  step: () => Promise<T>,
): Promise<T> {
  try {
    return await step();
  } catch (err) {
    throw err instanceof CkptGymError ? err : upstreamError(options, what, err);
  }
}

/**
 * Logs a backend failure at warn with its cause, which the client's detail leaves out (core's
 * error middleware logs anything untyped as an unhandled 500).
 */
function warnBackendFailure(logger: Logger, err: unknown): void {
  if (err instanceof UpstreamError) {
    logger.warn('the inference backend failed', { detail: err.detail, error: String(err.cause) });
  }
}

/** Checks a generation body and converts it to the chat request the backend is sent. */
function checkedGeneration(route: Route, body: Obj): Generation {
  let chatBody: Obj;
  if (route === 'responses') {
    chatBody = responsesToChatRequest(body);
  } else {
    // Lineage digests every chat message: a malformed one is the client's 422 before admission.
    checkChatMessages(body.messages);
    chatBody = body;
  }
  const requestDigest = createHash('sha256').update(JSON.stringify(chatBody)).digest('hex');
  return { route, body, chatBody, requestDigest, stream: chatBody.stream === true };
}

/** One checked generation request, ready to forward. */
interface Generation {
  route: Route;
  body: Obj;
  chatBody: Obj;
  requestDigest: string;
  stream: boolean;
}

/**
 * Forwards an admitted call and relays its answer. A failure is thrown to the lifecycle's error
 * path: a retire's reason when the ticket was retired, else the failure, a backend's logged.
 */
async function forward(
  options: ProxyOptions,
  backend: BackendClient,
  call: Generation,
  ticket: Ticket,
  res: Response,
  clientSignal: AbortSignal,
): Promise<void> {
  const { gate, ledger, logger } = options;
  const { route, body, chatBody, requestDigest, stream } = call;
  let lineage: CallLineage | undefined;
  const held = new HeldResponse(res, async (answer) => {
    await gate.deliver(ticket, clientSignal);
    options.cuts?.delivered(ticket);
    if (!answer || !ledger || !lineage || ticket.captureKey === undefined) return;
    // Published before any byte of the answer, outside every signal: a retire or a checkpoint
    // that arrives now waits for it (the ticket stays tracked, its response counts as started).
    await publishRow(
      options,
      ledger,
      ticket,
      ledgerRow(ticket, route, requestDigest, stream, answer, lineage),
    );
  });

  try {
    await options.afterAdmit?.(ticket).catch((err: unknown) => {
      throw new InternalError(`admitting the call failed: ${(err as Error).message}`);
    });
    let forwardBody = chatBody;
    if (ledger && ticket.captureKey !== undefined) {
      lineage = await dispatchLineage(options, ledger, ticket, chatBody);
      if (lineage.admission) forwardBody = { ...chatBody, ng_capture: lineage.admission };
    }
    const signal = AbortSignal.any([clientSignal, ticket.signal]);
    const target = backendTarget(
      options.backendUrl,
      ticket.captureKey,
      '/chat/completions',
      options.forwardRolloutPrefix,
    );
    const upstream = await fromBackend(options, 'could not be reached', () =>
      backend.request(target, {
        method: 'POST',
        headers: { 'content-type': 'application/json', ...authHeaders(options) },
        body: JSON.stringify(forwardBody),
        signal,
      }),
    );
    const isSse = (upstream.headers['content-type'] ?? '').includes('text/event-stream');
    if (!isOk(upstream) || !isSse) {
      await relayJson(options, call, upstream, held);
      return;
    }
    await fromBackend(options, 'broke off its answer', () =>
      relayStream(route, body, upstream, held),
    );
  } catch (err) {
    // The error middleware cuts a response that already started: nothing more can be said.
    if (ticket.signal.aborted) throw toClientError(ticket.signal.reason);
    if (!clientSignal.aborted) warnBackendFailure(logger, err);
    throw err;
  }
}

/** Appends a delivered call's ledger row; a failed write poisons the call (no answer is sent). */
async function publishRow(
  { logger }: ProxyOptions,
  ledger: CaptureLedger,
  ticket: Ticket,
  row: JsonObject,
): Promise<void> {
  const captureKey = ticket.captureKey!;
  try {
    const outcome = await ledger.append(captureKey, row);
    if (outcome === 'discarded') {
      logger.warn('capture ledger row discarded: the attempt is retired', {
        capture_key: captureKey,
        model_call_id: ticket.id,
        staging_key: row.staging_key,
      });
    }
  } catch (err) {
    logger.error('capture ledger write failed; the call is poisoned', {
      capture_key: captureKey,
      model_call_id: ticket.id,
      error: (err as Error).message,
    });
    throw new PoisonedCallError(
      `the capture ledger write for model call ${ticket.id} failed; no answer is sent`,
    );
  }
}

/** Relays a one-piece answer: a backend error as it is, a completion (converted for Responses). */
async function relayJson(
  options: ProxyOptions,
  { route, body }: Generation,
  upstream: IncomingMessage,
  held: HeldResponse,
): Promise<void> {
  const text = await fromBackend(options, 'broke off its answer', () => readText(upstream));
  if (!isOk(upstream)) {
    await held.start(upstream.statusCode ?? 502, JSON_HEADERS);
    held.end(text);
    return;
  }
  const completion = parseJson(text);
  if (!isObj(completion))
    throw upstreamError(options, 'answered with no JSON object', `HTTP 200 ${text.slice(0, 200)}`);
  const answer = {
    responseId:
      route === 'responses' ? `resp_${String(completion.id)}` : String(completion.id ?? ''),
    usage: isObj(completion.usage) ? completion.usage : undefined,
    coords: completion.ng_commit_coords,
    message: firstChoiceMessage(completion),
  };
  await held.start(200, JSON_HEADERS, answer);
  held.end(route === 'responses' ? JSON.stringify(chatToResponse(body, completion)) : text);
}

function firstChoiceMessage(completion: Obj): unknown {
  const choices = completion.choices;
  return Array.isArray(choices) && isObj(choices[0]) ? choices[0].message : undefined;
}

/**
 * Resolves the call's parent before dispatch and builds its capture admission, with the
 * continuation of a kept generation cut when the call re-issues the cut call's request.
 */
async function dispatchLineage(
  options: ProxyOptions,
  ledger: CaptureLedger,
  ticket: Ticket,
  chatBody: Obj,
): Promise<CallLineage> {
  const key = ticket.captureKey!;
  const messages: unknown[] = Array.isArray(chatBody.messages) ? chatBody.messages : [];
  const resolution = resolveParent(await ledger.exportRows(key), messages);
  if (resolution.kind === 'unresolved') {
    options.logger.warn('ledger lineage resolution failed; the call is not captured', {
      capture_key: key,
      model_call_id: ticket.id,
      reason: resolution.reason,
    });
    return { admission: null, failureReason: resolution.reason, messages };
  }
  const admission = captureAdmission(key, ticket.id, resolution);
  admission.generation_cut =
    options.cuts?.register({
      ticket,
      requestDigest: conversationDigest(messages),
      restartReason: cutRestartReason(chatBody),
      captured: true,
    }) ?? null;
  return { admission, failureReason: null, messages };
}

/** Relays an SSE answer: chat chunks as they are, or converted into Responses events. */
async function relayStream(
  route: Route,
  request: Obj,
  upstream: IncomingMessage,
  held: HeldResponse,
): Promise<void> {
  const reader = new SseReader();
  const decoder = new TextDecoder();
  const converter = route === 'responses' ? new ResponsesStream(request) : undefined;
  let done = false;

  const relay = async (event: SseEvent): Promise<void> => {
    if (event.data === undefined) {
      // Keep-alive comments start nothing; once started they may pass.
      if (held.started) held.write(`${event.raw}\n\n`);
      return;
    }
    if (event.data === '[DONE]') {
      done = true;
      if (!held.started) await held.start(200, SSE_HEADERS);
      if (converter) writeEvents(held, converter.finish());
      else held.write(`${event.raw}\n\n`);
      return;
    }
    const chunk = parseJson(event.data);
    if (!held.started) {
      const first = isObj(chunk) ? chunk : {};
      const id = String(first.id ?? '');
      await held.start(200, SSE_HEADERS, {
        responseId: converter ? `resp_${id}` : id,
        usage: undefined,
        coords: first.ng_commit_coords,
        message: undefined,
      });
    }
    if (converter) writeEvents(held, isObj(chunk) ? converter.chunk(chunk) : []);
    else held.write(`${event.raw}\n\n`);
  };

  for await (const bytes of upstream) {
    for (const event of reader.push(decoder.decode(bytes as Buffer, { stream: true }))) {
      await relay(event);
    }
  }
  for (const event of reader.push(decoder.decode())) await relay(event);
  for (const event of reader.flush()) await relay(event);
  if (!held.started) await held.start(200, SSE_HEADERS);
  if (converter && !done) writeEvents(held, converter.finish());
  held.end();
}

function writeEvents(held: HeldResponse, events: Obj[]): void {
  for (const event of events)
    held.write(`event: ${String(event.type)}\ndata: ${JSON.stringify(event)}\n\n`);
}
