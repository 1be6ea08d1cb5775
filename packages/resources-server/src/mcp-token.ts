/**
 * The MCP session token: what a harness that calls tools over MCP carries instead of the session
 * cookie, as `Authorization: Bearer <token>`. It is a signed JSON object (cookie.ts's
 * `SignedValues` format) naming the session and the tools it may call; with checkpointing on it
 * also carries an `episode` claim, the seeding attempt's capture key, which decides whether the
 * attempt may still use it after a restore. The key is derived from the session secret, so a
 * restored process reads the tokens its predecessor minted (and refuses their stale attempts).
 */
import { createHmac } from 'node:crypto';

import {
  captureKey,
  type EpisodeId,
  isCaptureKey,
  parseCaptureKey,
  StaleAttemptError,
  UnauthorizedError,
} from '@ckpt-gym/core/protocol';

import { isRoutingId } from '@ckpt-gym/core/server';

import { SignedValues } from './cookie.js';

export interface McpTokenClaims {
  readonly session_id: string;
  readonly tools: readonly string[];
  /** The seeding attempt's capture key; present exactly when checkpointing is on. */
  readonly episode?: string;
  /** The worker that owns the session (its routing id), on a server with several workers. */
  readonly owner?: string;
}

/** The token key, derived from the session secret (deterministic whenever the secret is). */
export function mcpTokenKey(sessionSecret: Buffer): Buffer {
  return createHmac('sha256', sessionSecret).update('ckpt-gym resources mcp token').digest();
}

function isClaims(value: unknown): value is McpTokenClaims {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) return false;
  const claims = value as Record<string, unknown>;
  return (
    typeof claims.session_id === 'string' &&
    claims.session_id !== '' &&
    Array.isArray(claims.tools) &&
    claims.tools.every((t) => typeof t === 'string') &&
    (claims.episode === undefined ||
      (typeof claims.episode === 'string' && isCaptureKey(claims.episode))) &&
    (claims.owner === undefined || isRoutingId(claims.owner))
  );
}

export class McpTokens {
  readonly #values: SignedValues;
  readonly #owner: string | undefined;

  /** `owner`: this worker's routing id, which its tokens name, on a server with several workers. */
  constructor(key: Buffer, owner?: string) {
    this.#values = new SignedValues(key);
    this.#owner = owner;
  }

  /** The token of a session; `episode` only with checkpointing on. */
  mint(sessionId: string, tools: readonly string[], episode: EpisodeId | undefined): string {
    const claims: McpTokenClaims = {
      session_id: sessionId,
      tools: [...tools],
      ...(episode ? { episode: captureKey(episode) } : {}),
      ...(this.#owner === undefined ? {} : { owner: this.#owner }),
    };
    return this.#values.sign(JSON.stringify(claims));
  }

  /** The claims of an `Authorization: Bearer` header; 401 `unauthorized` for a missing or bad token. */
  read(authorization: string | undefined): McpTokenClaims {
    const match = /^Bearer\s+(\S+)$/i.exec(authorization ?? '');
    const text = match ? this.#values.verify(match[1] as string) : undefined;
    let claims: unknown;
    try {
      claims = text === undefined ? undefined : JSON.parse(text);
    } catch {
      claims = undefined;
    }
    if (!isClaims(claims)) {
      throw new UnauthorizedError(
        'MCP calls need the session token the seed returned, as a Bearer token',
      );
    }
    return claims;
  }
}

/**
 * The attempt a token's call runs as. With checkpointing on a token must name one (a token minted
 * without, or by a process with checkpointing off, cannot tell a replacement from the attempt it
 * replaced): 409 `stale_attempt`. With it off the attempt is not checked.
 */
export function tokenAttempt(
  claims: McpTokenClaims,
  checkpointing: boolean,
): EpisodeId | undefined {
  if (!checkpointing) return undefined;
  if (claims.episode === undefined) {
    throw new StaleAttemptError(
      `the MCP token of resources session '${claims.session_id}' names no attempt; seed the session again under its attempt for a new token`,
    );
  }
  return parseCaptureKey(claims.episode);
}
