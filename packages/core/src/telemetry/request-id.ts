/**
 * Request ids: every request a gym server serves has one, taken from its `x-request-id` header
 * when that is sane (a bounded, printable token: it lands in log lines and in other servers'
 * headers) and minted otherwise. The id is echoed on the reply and lives in an AsyncLocalStorage
 * while the request's work runs, so every call that work makes to another server carries it (the
 * got clients' hook, the policy's backend calls, the agent's MCP connections).
 */
import { AsyncLocalStorage } from 'node:async_hooks';
import { randomUUID } from 'node:crypto';

import type { Logger } from '../logging.js';

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
}

const currentRequest = new AsyncLocalStorage<RequestScope>();

/** Runs `work` (and everything it starts) as part of the request `scope`. */
export function withRequestScope<T>(scope: RequestScope, work: () => T): T {
  return currentRequest.run(scope, work);
}

/** The request whose work is running, if any. */
export function currentRequestScope(): RequestScope | undefined {
  return currentRequest.getStore();
}

/** The header that passes the current request's id on to another server (none outside a request). */
export function requestIdHeaders(): Record<string, string> {
  const id = currentRequest.getStore()?.id;
  return id === undefined ? {} : { [REQUEST_ID_HEADER]: id };
}
