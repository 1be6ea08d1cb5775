/**
 * Outgoing HTTP: two got clients on two keep-alive agents. Data calls (a `/run` parked for a
 * checkpoint, a held model response) may hold every data connection to a host for minutes; control
 * calls (prepare, commit, resume, generation cuts) travel on a reserved pool so they never queue
 * behind them.
 */
import { Agent, type AgentOptions, type ClientRequestArgs } from 'node:http';
import { Agent as HttpsAgent, type AgentOptions as HttpsAgentOptions } from 'node:https';
import type { Duplex } from 'node:stream';
import type { Socket } from 'node:net';

import got, { type BeforeRequestHook, type Got, HTTPError, RequestError, type Response } from 'got';

import { ConfigError, type ErrorCode, isErrorCode, UpstreamError } from './errors.js';
import {
  DEFAULT_CONTROL_CONNECTION_LIMIT,
  DEFAULT_CONTROL_CONNECTION_LIMIT_PER_HOST,
  type PoolLimits,
} from './settings.js';
import { currentRequestScope, REQUEST_ID_HEADER } from './telemetry/request-id.js';
import { injectTraceContext } from './telemetry/request-spans.js';

/** Idle keep-alive sockets are closed after this long (the server's shorter hint wins). */
export const KEEP_ALIVE_IDLE_MS = 15_000;
/** TCP keep-alive probes start after this much silence on a socket (not on loopback). */
export const TCP_KEEP_ALIVE_INITIAL_DELAY_MS = 60_000;

/** True for an address of this host's loopback (127.0.0.0/8, ::1, or IPv4-mapped 127.x). */
export function isLoopbackAddress(address: string | undefined): boolean {
  if (address === undefined) return false;
  const v4 = address.startsWith('::ffff:') ? address.slice('::ffff:'.length) : address;
  return v4.startsWith('127.') || address === '::1';
}

/**
 * Whether a connection to `remoteAddress` sends TCP keep-alive probes: not on loopback. There a
 * peer that dies is closed by the kernel at once, so probes find nothing, and they can kill a
 * live call: on a saturated host the loopback's input backlog drops packets, data is retransmitted
 * but a probe is not, and ten probes dropped in a row (libuv's 10 × 1 s) abort an idle, held
 * connection with ETIMEDOUT. Across a network, probes are what finds a peer that vanished.
 */
export function sendsTcpKeepAlive(remoteAddress: string | undefined): boolean {
  return !isLoopbackAddress(remoteAddress);
}

// A mixin's base must take `any[]` (TypeScript's rule for mixin constructors).
// eslint-disable-next-line @typescript-eslint/no-explicit-any
type AgentClass = new (...args: any[]) => Agent;

/** `Base` (node's http or https agent) whose sockets probe only where `sendsTcpKeepAlive`. */
function probingOffLoopback<B extends AgentClass>(Base: B) {
  return class extends Base {
    override createConnection(
      options: ClientRequestArgs,
      callback?: (err: Error | null, socket: Duplex) => void,
    ): Duplex {
      // Probes wait for the peer's address; node's agent would turn them on before the connect.
      const noProbes = { ...options, keepAlive: false } as ClientRequestArgs;
      const socket = super.createConnection(noProbes, callback) as Socket;
      socket.once('connect', () => applyTcpKeepAlive(socket));
      return socket;
    }

    // @types/node says void, but node's agent pools the socket only when this returns true.
    override keepSocketAlive(socket: Duplex): void {
      const keep = Base.prototype.keepSocketAlive as unknown as (socket: Duplex) => boolean;
      const kept = keep.call(this, socket); // turns probes on for every pooled socket
      applyTcpKeepAlive(socket as Socket);
      return kept as unknown as void;
    }
  };
}

const PooledAgent = probingOffLoopback(Agent);
const PooledHttpsAgent = probingOffLoopback(HttpsAgent);

/** node's http agent, its sockets sending TCP keep-alive probes only off loopback. */
export function pooledHttpAgent(options: AgentOptions): Agent {
  return new PooledAgent(options);
}

/** node's https agent, its sockets sending TCP keep-alive probes only off loopback. */
export function pooledHttpsAgent(options: HttpsAgentOptions): HttpsAgent {
  return new PooledHttpsAgent(options);
}

function applyTcpKeepAlive(socket: Socket): void {
  if (sendsTcpKeepAlive(socket.remoteAddress)) {
    socket.setKeepAlive(true, TCP_KEEP_ALIVE_INITIAL_DELAY_MS);
  } else {
    socket.setKeepAlive(false);
  }
}

export const DEFAULT_CONTROL_POOL: PoolLimits = {
  maxTotalSockets: DEFAULT_CONTROL_CONNECTION_LIMIT,
  maxSockets: DEFAULT_CONTROL_CONNECTION_LIMIT_PER_HOST,
};
export const DEFAULT_DATA_POOL: PoolLimits = { maxTotalSockets: 0, maxSockets: 0 };

/** Pool limits per client; 0 or `Infinity` means unlimited. */
export interface HttpClientLimits {
  readonly data?: PoolLimits;
  readonly control?: PoolLimits;
}

export interface HttpClients {
  /** Data-plane calls. got defaults otherwise; callers choose their own retries and timeouts. */
  readonly data: Got;
  /** Control calls only: no retries (coordination decides), no default timeout. */
  readonly control: Got;
  /** Destroys both pools' sockets. */
  close(): void;
}

function agentLimit(pool: string, key: string, value: number): number {
  if (value === Infinity || value === 0) return Infinity;
  if (!Number.isSafeInteger(value) || value < 0) {
    throw new ConfigError(
      `${pool} pool ${key} must be an integer ≥ 0 (0 = unlimited), got ${value}`,
    );
  }
  return value;
}

function keepAliveAgent(pool: string, limits: PoolLimits): Agent {
  return new PooledAgent({
    keepAlive: true,
    keepAliveMsecs: TCP_KEEP_ALIVE_INITIAL_DELAY_MS,
    timeout: KEEP_ALIVE_IDLE_MS,
    maxSockets: agentLimit(pool, 'maxSockets', limits.maxSockets),
    maxTotalSockets: agentLimit(pool, 'maxTotalSockets', limits.maxTotalSockets),
  });
}

/**
 * A call made for a request carries its id on (unless the caller set one), and every call the
 * caller's trace context (`traceparent`) when tracing is on.
 */
const passRequestContext: BeforeRequestHook = (options) => {
  const id = currentRequestScope()?.id;
  if (id !== undefined) options.headers[REQUEST_ID_HEADER] ??= id;
  injectTraceContext(options.headers);
};

/** Builds the data and control clients; a negative or fractional limit is a `ConfigError`. */
export function createHttpClients(limits: HttpClientLimits = {}): HttpClients {
  const dataAgent = keepAliveAgent('data', limits.data ?? DEFAULT_DATA_POOL);
  const controlAgent = keepAliveAgent('control', limits.control ?? DEFAULT_CONTROL_POOL);
  const hooks = { beforeRequest: [passRequestContext] };
  return {
    data: got.extend({ agent: { http: dataAgent }, hooks }),
    control: got.extend({ agent: { http: controlAgent }, retry: { limit: 0 }, hooks }),
    close() {
      dataAgent.destroy();
      controlAgent.destroy();
    },
  };
}

/** A control call answered with a status other than 200. */
export class ControlHttpError extends Error {
  /**
   * The catalogue code of the refusal (`if (err.code === 'stale_checkpoint')`), or undefined when
   * the body is not a ckpt-gym error: another shape, or a code the catalogue does not define (the
   * message still shows it).
   */
  readonly code: ErrorCode | undefined;

  constructor(
    readonly url: string,
    /** The HTTP status received. */
    readonly status: number,
    /** `error.code` of the reply body, when the body has the standard error shape. */
    replyCode: string | undefined,
    /** `error.detail`, or the first 200 bytes of the body. */
    readonly detail: string,
  ) {
    super([`HTTP ${status}`, replyCode, detail.trim()].filter(Boolean).join(' '));
    this.name = 'ControlHttpError';
    this.code = isErrorCode(replyCode) ? replyCode : undefined;
  }
}

/** A 200 reply whose body is not a JSON object. */
export class ControlReplyError extends Error {
  constructor(
    readonly url: string,
    detail: string,
  ) {
    super(`invalid control reply from ${url}: ${detail}`);
    this.name = 'ControlReplyError';
  }
}

/** No reply within the call's timeout (the connection may have been queued, open or replying). */
export class ControlTimeoutError extends Error {
  constructor(
    readonly url: string,
    readonly timeoutMs: number,
  ) {
    super(`no reply from ${url} within ${timeoutMs} ms`);
    this.name = 'ControlTimeoutError';
  }
}

export interface ControlCallOptions {
  token: string;
  /** Bounds the whole call, reply included; none when omitted. */
  timeoutMs?: number;
  signal?: AbortSignal;
}

const BODY_EXCERPT_BYTES = 200;

/** The code and detail of a failed reply: the standard error shape when present, else the raw text. */
function describeFailedReply(body: Buffer): { code: string | undefined; detail: string } {
  const excerpt = body.subarray(0, BODY_EXCERPT_BYTES).toString('utf8');
  let parsed: unknown;
  try {
    parsed = JSON.parse(body.toString('utf8'));
  } catch {
    return { code: undefined, detail: excerpt };
  }
  const error = (parsed as { error?: unknown } | null)?.error as
    Record<string, unknown> | undefined;
  const code = typeof error?.code === 'string' ? error.code : undefined;
  const detail = typeof error?.detail === 'string' ? error.detail : excerpt;
  return { code, detail };
}

/** Combines the caller's signal with the call's own timeout. */
function callSignal(options: ControlCallOptions): { signal?: AbortSignal; timeout?: AbortSignal } {
  const timeout =
    options.timeoutMs === undefined ? undefined : AbortSignal.timeout(Math.ceil(options.timeoutMs));
  const signals = [options.signal, timeout].filter((s): s is AbortSignal => s !== undefined);
  const signal = signals.length > 1 ? AbortSignal.any(signals) : signals[0];
  return { ...(signal ? { signal } : {}), ...(timeout ? { timeout } : {}) };
}

async function controlCall(
  client: Got,
  method: 'GET' | 'POST',
  url: string,
  body: Buffer | undefined,
  options: ControlCallOptions,
): Promise<Record<string, unknown>> {
  const headers: Record<string, string> = { authorization: `Bearer ${options.token}` };
  if (body !== undefined) headers['content-type'] = 'application/json';
  // A signal, not got's own request timeout: that one never fires while the request waits in
  // the agent's queue for a socket.
  const { signal, timeout } = callSignal(options);
  let response: Response<Buffer>;
  try {
    response = await client(url, {
      method,
      body,
      headers,
      responseType: 'buffer',
      throwHttpErrors: false,
      retry: { limit: 0 },
      ...(signal ? { signal } : {}),
    });
  } catch (err) {
    if (timeout?.aborted && !options.signal?.aborted) {
      throw new ControlTimeoutError(url, Math.ceil(options.timeoutMs ?? 0));
    }
    throw err;
  }
  if (response.statusCode !== 200) {
    const { code, detail } = describeFailedReply(response.body);
    throw new ControlHttpError(url, response.statusCode, code, detail);
  }
  let parsed: unknown;
  try {
    parsed = JSON.parse(response.body.toString('utf8'));
  } catch (err) {
    throw new ControlReplyError(url, `not JSON: ${(err as Error).message}`);
  }
  if (typeof parsed !== 'object' || parsed === null || Array.isArray(parsed)) {
    throw new ControlReplyError(url, 'not a JSON object');
  }
  return parsed as Record<string, unknown>;
}

/**
 * POSTs already-encoded JSON bytes with the control bearer, without retries; a non-200 reply is a
 * `ControlHttpError`, a 200 is the parsed JSON object.
 */
export function postControl(
  client: Got,
  url: string,
  body: Buffer,
  options: ControlCallOptions,
): Promise<Record<string, unknown>> {
  return controlCall(client, 'POST', url, body, options);
}

/** GETs a control route (status) with the bearer, without retries; errors as `postControl`. */
export function getControl(
  client: Got,
  url: string,
  options: ControlCallOptions,
): Promise<Record<string, unknown>> {
  return controlCall(client, 'GET', url, undefined, options);
}

/**
 * POSTs JSON to an upstream server on the data plane: once (never re-sent) and whatever the reply's
 * status. A failure on the way (refused, reset, timed out) is a 502 `upstream_error` naming `url`;
 * our own abort stays an abort.
 */
export function postUpstream(
  http: Got,
  url: string,
  options: { json: unknown; headers?: Record<string, string>; signal: AbortSignal },
): Promise<Response<string>> {
  return upstreamPost(http)(url, options).catch((err: unknown) => {
    throw upstreamFailure(url, err, options.signal);
  });
}

/** Each client's `postUpstream` instance: got merges a call's options into its defaults per call. */
const upstreamPosts = new WeakMap<Got, Got>();

function upstreamPost(http: Got): Got {
  let post = upstreamPosts.get(http);
  if (post === undefined) {
    post = http.extend({ method: 'POST', throwHttpErrors: false, retry: { limit: 0 } });
    upstreamPosts.set(http, post);
  }
  return post;
}

/** The error a failed `postUpstream` throws: ours stopped it (an abort), or it failed on the way. */
function upstreamFailure(url: string, err: unknown, signal: AbortSignal): unknown {
  if (signal.aborted) {
    logTimedOutCall(url, err, signal);
    return err;
  }
  const onTheWay =
    err instanceof RequestError && !(err instanceof HTTPError) && err.name !== 'AbortError';
  if (!onTheWay) return err;
  const target = withoutSecrets(url);
  const scope = currentRequestScope();
  scope?.logger.warn('upstream call failed', {
    target,
    request_id: scope.id,
    error: err.code || err.message,
  });
  return new UpstreamError(`${target}: ${err.code || err.message}`, { cause: err });
}

/**
 * Where a call's time went, in ms from its start (got's timings): when it had a socket, was
 * connected, had sent its request and had the reply's head; null where it never got that far.
 */
interface CallMilestones {
  readonly socket_ms: number | null;
  readonly connected_ms: number | null;
  readonly sent_ms: number | null;
  readonly reply_ms: number | null;
}

function callMilestones(err: unknown): CallMilestones {
  const timings = err instanceof RequestError ? err.timings : undefined;
  const since = (at: number | undefined) =>
    timings === undefined || at === undefined ? null : at - timings.start;
  return {
    socket_ms: since(timings?.socket),
    connected_ms: since(timings?.connect),
    sent_ms: since(timings?.upload),
    reply_ms: since(timings?.response),
  };
}

/**
 * Logs a call that its timeout stopped (`signal`'s reason a `TimeoutError`; a caller going away is
 * not logged) with its target and where its time went: no socket, a connection slow to open, or a
 * peer slow to answer.
 */
export function logTimedOutCall(url: string, err: unknown, signal: AbortSignal): void {
  if ((signal.reason as Error | undefined)?.name !== 'TimeoutError') return;
  const scope = currentRequestScope();
  scope?.logger.warn('upstream call timed out', {
    target: withoutSecrets(url),
    request_id: scope.id,
    ...callMilestones(err),
  });
}

/** A URL fit for a log line or an error detail: no credentials, no query (where keys travel). */
export function withoutSecrets(url: string): string {
  try {
    const parsed = new URL(url);
    parsed.username = '';
    parsed.password = '';
    parsed.search = '';
    return parsed.href;
  } catch {
    return '(an invalid URL)';
  }
}
