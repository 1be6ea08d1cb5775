/**
 * The control routes of one participant, spoken the way a controller does (core's control HTTP
 * client, the bearer token), with replies a test can assert on whatever their status.
 */
import { CHECKPOINT_ROUTE_PREFIX, createHttpClients, getControl } from '@ckpt-gym/core/client';
import { type EpisodeId } from '@ckpt-gym/core/protocol';

import { deadline } from './wait.js';

export type Json = Record<string, unknown>;

/** A reply of any status; `body` is `{}` when the reply had none. */
export interface ControlReply {
  status: number;
  body: Json;
}

export interface ControlClient extends AsyncDisposable {
  readonly url: string;
  /** POSTs `body` to `/ng-control/v1/checkpoint/<route>` as it is (no deadline added). */
  post(route: string, body?: Json): Promise<ControlReply>;
  /** GETs `/ng-control/v1/checkpoint/<route>` (the status route), whatever the reply's status. */
  get(route: string): Promise<ControlReply>;
  /** POSTs with a 30 s `deadline_ts` unless `body` has one; fails unless the reply is a 200. */
  ok(route: string, body: Json): Promise<Json>;
  status(): Promise<Json>;
  prepare(checkpointId: string, body?: Json): Promise<Json>;
  commit(checkpointId: string, dir: string, scope: readonly EpisodeId[] | null): Promise<Json>;
  restore(checkpointId: string, dir: string, scope: readonly EpisodeId[]): Promise<Json>;
  resume(checkpointId: string): Promise<Json>;
  retire(checkpointId: string, scope: readonly EpisodeId[]): Promise<Json>;
  forget(checkpointId: string, rolloutIds: readonly string[]): Promise<Json>;
  close(): void;
}

/** The reply's JSON object; a reply that is none (an HTML 404 of a bare app) as `{ text }`. */
function parse(text: string): Json {
  if (text.length === 0) return {};
  try {
    return JSON.parse(text) as Json;
  } catch {
    return { text };
  }
}

/** A control client for the participant at `url`; `await using` closes its connections. */
export function controlClient(url: string, token: string): ControlClient {
  const clients = createHttpClients();
  const base = `${url}${CHECKPOINT_ROUTE_PREFIX}`;
  const call = async (route: string, body?: Json): Promise<ControlReply> => {
    const res = await clients.control(`${base}/${route}`, {
      method: body === undefined ? 'GET' : 'POST',
      ...(body === undefined ? {} : { json: body }),
      headers: { authorization: `Bearer ${token}` },
      responseType: 'text',
      throwHttpErrors: false,
      retry: { limit: 0 },
    });
    return { status: res.statusCode, body: parse(res.body) };
  };
  const post = (route: string, body: Json = {}) => call(route, body);
  const ok = async (route: string, body: Json): Promise<Json> => {
    const reply = await post(route, { deadline_ts: deadline(), ...body });
    if (reply.status !== 200) {
      throw new Error(`${route} failed: ${reply.status} ${JSON.stringify(reply.body)}`);
    }
    return reply.body;
  };
  const close = () => clients.close();
  return {
    url,
    post,
    get: (route) => call(route),
    ok,
    status: () => getControl(clients.control, `${base}/status`, { token }),
    prepare: (id, body = {}) => ok('prepare', { checkpoint_id: id, ...body }),
    commit: (id, dir, scope) =>
      ok('commit', { checkpoint_id: id, checkpoint_dir: dir, episode_ids: scope }),
    restore: (id, dir, scope) =>
      ok('restore', { checkpoint_id: id, checkpoint_dir: dir, episode_ids: scope }),
    resume: (id) => ok('resume', { checkpoint_id: id }),
    retire: (id, scope) => ok('retire', { checkpoint_id: id, episode_ids: scope }),
    forget: (id, rolloutIds) => ok('forget', { checkpoint_id: id, rollout_ids: rolloutIds }),
    close,
    [Symbol.asyncDispose]: async () => close(),
  };
}
