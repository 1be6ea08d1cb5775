/**
 * Request ids: every request a gym server serves has one, taken from its `x-request-id` header
 * when that is sane (a bounded, printable token: it lands in log lines and in other servers'
 * headers) and minted otherwise. The id is echoed on the reply and lives in the request's async
 * context while its work runs, so every call that work makes to another server carries it (the
 * got clients' hook, the policy's backend calls, the agent's MCP connections).
 *
 * One async context per request: while tracing is on the scope rides in OpenTelemetry's context
 * (its context manager is an AsyncLocalStorage already), else in an AsyncLocalStorage of its own.
 * Two stores would each be copied onto every promise the request's work makes.
 */
import { AsyncLocalStorage } from 'node:async_hooks';
import { randomUUID } from 'node:crypto';

import { type Context, context, createContextKey, ROOT_CONTEXT } from '@opentelemetry/api';

import type { Logger } from '../logging.js';
import type { TraceCarrier } from './request-spans.js';
import { tracingOn } from './tracing.js';

export const REQUEST_ID_HEADER = 'x-request-id';

/** Up to 128 of the characters ids are made of (UUIDs, ULIDs, trace-style and dotted ids). */
const SANE_REQUEST_ID = /^[A-Za-z0-9._:+=@/-]{1,128}$/;

/** The caller's id when it is sane, else a fresh one (a repeated header is not one id). */
export function requestIdFor(header: string | string[] | undefined): string {
  return typeof header === 'string' && SANE_REQUEST_ID.test(header) ? header : randomUUID();
}

/** The request whose work is running: its id, and the logger of the server serving it. */
export interface RequestScope {
  readonly id: string;
  readonly logger: Logger;
  /**
   * While tracing is on, the request's span once its route has opened one, or the caller's trace
   * headers when its trace is not sampled.
   */
  span?: TraceCarrier;
}

/** Where the request's scope is kept while tracing is off. */
const currentRequest = new AsyncLocalStorage<RequestScope>();

/** Where it is kept in OpenTelemetry's context while tracing is on. */
export const REQUEST_SCOPE_KEY = createContextKey('ckpt-gym request scope');

/**
 * A request's context while tracing is on: the root context with its scope, as one small object.
 * The API's own (`ROOT_CONTEXT.setValue`) is a Map and three closures a request, and the async
 * context is copied onto everything the request's work starts: with it a traced server spent
 * 1.156× the CPU of an untraced one on a request under an unsampled caller, most of the
 * difference in garbage collection; with this one 1.02–1.04× (`npm run bench -- tracing-route`).
 * A value set on it gives the API's own context.
 */
class RequestScopeContext implements Context {
  constructor(readonly scope: RequestScope) {}

  getValue(key: symbol): unknown {
    return key === REQUEST_SCOPE_KEY ? this.scope : undefined;
  }

  setValue(key: symbol, value: unknown): Context {
    return ROOT_CONTEXT.setValue(REQUEST_SCOPE_KEY, this.scope).setValue(key, value);
  }

  deleteValue(key: symbol): Context {
    return key === REQUEST_SCOPE_KEY ? ROOT_CONTEXT : this;
  }
}

/**
 * Runs `work` (and everything it starts) as part of the request `scope`. With tracing on, from the
 * root context: a request's trace starts from its caller's `traceparent`, never from whatever
 * context the server's socket was opened in.
 */
export function withRequestScope<T>(scope: RequestScope, work: () => T): T {
  if (tracingOn()) return context.with(new RequestScopeContext(scope), work);
  return currentRequest.run(scope, work);
}

/** The request whose work is running, if any. */
export function currentRequestScope(): RequestScope | undefined {
  // While tracing is off the API's context is always the root: one lookup, then the storage.
  const traced = context.active().getValue(REQUEST_SCOPE_KEY) as RequestScope | undefined;
  return traced ?? currentRequest.getStore();
}

/** The header that passes the current request's id on to another server (none outside a request). */
export function requestIdHeaders(): Record<string, string> {
  const id = currentRequestScope()?.id;
  return id === undefined ? {} : { [REQUEST_ID_HEADER]: id };
}
