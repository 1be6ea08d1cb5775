/**
 * Simple Agent's legacy whole-episode `/run`: seed the resources session, run the turn loop (a
 * self-dispatch to this server's own `/v1/responses` as activation 1 of the `run:<rollout>`
 * session), verify, return. Each stage starts at a protocol boundary `{"next": …}`, so a restored
 * run continues from the stage it had reached and a state-changing verify never runs twice.
 */
import { postUpstream } from '@ckpt-gym/core/client';
import {
  activationHeader,
  CHECKPOINT_CLOSE_FOLLOWS_HEADER,
  CHECKPOINT_RESTART_HEADER,
  CHECKPOINT_VERIFY_HEADER,
  type EpisodeId,
  errorFromBody,
  type JsonObject,
  withRolloutPrefix,
} from '@ckpt-gym/core/protocol';
import {
  type Boundary,
  type EpisodeContext,
  type Logger,
  type StepMode,
} from '@ckpt-gym/core/server';
import type { Got } from 'got';

import { mergeSetCookies } from './sessions.js';

export interface LegacyRunSettings {
  resourcesServerUrl: string;
  skipVerification: boolean;
  skipVerificationReward: number;
}

export interface LegacyRunParts {
  http: Got;
  settings: LegacyRunSettings;
  body: JsonObject;
  episode: EpisodeId | undefined;
  /** This server's own base URL, for the self-dispatch. */
  selfUrl: string;
  /** Headers of the self-dispatch: on a worker, the one routing it back to this worker. */
  selfHeaders: Readonly<Record<string, string>>;
  /** The request's cookies (the resources session's, when the caller seeded it). */
  cookies: Record<string, string>;
  ep: EpisodeContext;
  logger: Logger;
  /** The turn loop's reply is now held by a protocol boundary: the kept activation reply can go. */
  loopReplied?: () => void;
}

type Stage = 'seed' | 'loop' | 'verify' | 'return';

function cookieHeader(jar: Record<string, string>): Record<string, string> {
  const entries = Object.entries(jar);
  return entries.length === 0 ? {} : { cookie: entries.map(([k, v]) => `${k}=${v}`).join('; ') };
}

function parse(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return undefined;
  }
}

/** A work context for a `/run` nothing checkpoints. */
export function untrackedEpisode(key: string, signal: AbortSignal): EpisodeContext {
  return {
    key,
    signal,
    continuation: () => null,
    boundary: async () => undefined,
    step: (_mode, fn) => fn(),
    markRestart: async () => undefined,
    finishing: () => undefined,
  };
}

export async function legacyRun(parts: LegacyRunParts): Promise<JsonObject> {
  const { settings, body, episode, ep } = parts;
  const { url, post } = runCalls(parts);

  const cont = (ep.continuation() ?? {}) as Boundary;
  let stage = (cont.next as Stage | undefined) ?? 'seed';
  let cookies = (cont.cookies as Record<string, string> | undefined) ?? { ...parts.cookies };
  let verifyMode = ((cont.verify_mode as StepMode | undefined) ?? 'wait') as StepMode;
  let response = (cont.response as JsonObject | undefined) ?? null;
  let result = (cont.result as JsonObject | undefined) ?? null;
  // A replayable verify leaves the resources session open until this run closes it.
  let closeAfter = cont.close === true;

  if (stage === 'seed') {
    await ep.boundary({ next: 'seed' });
    const seeded = await ep.step('replay', () =>
      post(url('/seed_session'), body, cookieHeader(cookies)),
    );
    cookies = mergeSetCookies(cookies, seeded.headers['set-cookie'] as string[] | undefined) ?? {};
    verifyMode = seeded.headers[CHECKPOINT_VERIFY_HEADER] === 'replay' ? 'replay' : 'wait';
    if (seeded.headers[CHECKPOINT_RESTART_HEADER] === '1') await ep.markRestart();
    stage = 'loop';
  }
  if (stage === 'loop') {
    await ep.boundary({ next: 'loop', cookies, verify_mode: verifyMode });
    const self = episode
      ? withRolloutPrefix(parts.selfUrl, episode, '/v1/responses')
      : `${parts.selfUrl}/v1/responses`;
    const reply = await ep.step('replay', () =>
      post(self, body.responses_create_params ?? {}, {
        ...cookieHeader(cookies),
        ...activationHeader(1),
        ...parts.selfHeaders,
      }),
    );
    response = reply.body;
    if (settings.skipVerification) {
      result = {
        ...body,
        response,
        reward: settings.skipVerificationReward,
        verification_skipped: true,
      };
      parts.loopReplied?.();
      await ep.boundary({ next: 'return', response, result });
      stage = 'return';
    } else {
      stage = 'verify';
    }
  }
  if (stage === 'verify') {
    parts.loopReplied?.();
    await ep.boundary({ next: 'verify', response, cookies, verify_mode: verifyMode });
    closeAfter = verifyMode === 'replay';
    const verified = await ep.step(verifyMode, () =>
      post(
        url('/verify'),
        { ...body, response },
        {
          ...cookieHeader(cookies),
          ...(closeAfter ? { [CHECKPOINT_CLOSE_FOLLOWS_HEADER]: '1' } : {}),
        },
      ),
    );
    result = verified.body;
    await ep.boundary({ next: 'return', response, result, close: closeAfter, cookies });
  }
  ep.finishing();
  if (closeAfter) await closeAfterRun(parts, cookies);
  return withTrajectory(result ?? {});
}

/** The calls of a run: resources URLs under the episode's prefix, and a POST that checks its answer. */
function runCalls({ http, settings, episode, ep }: LegacyRunParts) {
  const url = (path: string) =>
    episode
      ? withRolloutPrefix(settings.resourcesServerUrl, episode, path)
      : `${settings.resourcesServerUrl}${path}`;
  const post = async (target: string, json: unknown, headers: Record<string, string>) => {
    const res = await postUpstream(http, target, { json, headers, signal: ep.signal });
    const parsed = parse(res.body);
    if (res.statusCode < 200 || res.statusCode >= 300) throw errorFromBody(res.statusCode, parsed);
    return { body: parsed as JsonObject, headers: res.headers };
  };
  return { url, post };
}

/** Closes the resources session a replayable verify left open; a failure leaves the verdict. */
async function closeAfterRun(parts: LegacyRunParts, cookies: Record<string, string>) {
  const { url, post } = runCalls(parts);
  try {
    await post(url('/close_session'), {}, cookieHeader(cookies));
  } catch (err) {
    parts.logger.warn('closing the resources session after /run failed; the verdict stands', {
      error: (err as Error).message,
    });
  }
}

/** `/run` returns the loop's trajectory as `ng_trajectory`, outside its response. */
function withTrajectory(result: JsonObject): JsonObject {
  const response = result.response as JsonObject | undefined;
  if (!response || typeof response !== 'object' || !('_ng_trajectory' in response)) return result;
  const { _ng_trajectory, ...rest } = response;
  return { ...result, response: rest, ng_trajectory: _ng_trajectory ?? null };
}
