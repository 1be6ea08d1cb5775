/**
 * The signed session cookie: `<base64url session id>.<base64url HMAC-SHA256>`. A request without
 * a valid cookie gets a new session id. The secret must outlive a crash when checkpointing is on
 * (a restored session is found by the cookie the client kept), so it is configured or derived from
 * the control token; only with checkpointing off may it be random per process.
 */
import { createHmac, randomBytes, randomUUID, timingSafeEqual } from 'node:crypto';

import { ownedName, parseOwnedName, type SessionRef } from '@ckpt-gym/core/server';

export const SESSION_ID_KEY = 'session_id';

export function sessionCookieName(serverName: string): string {
  return `ckpt_gym_session___${serverName}`;
}

/** The secret: configured, else derived from the control token, else random for this process. */
export function sessionSecret(parts: {
  configured?: string | undefined;
  controlAuthToken?: string | undefined;
  serverName: string;
}): Buffer {
  if (parts.configured) return Buffer.from(parts.configured, 'utf8');
  if (parts.controlAuthToken) {
    return createHmac('sha256', parts.controlAuthToken)
      .update(`ckpt-gym resources session cookie: ${parts.serverName}`)
      .digest();
  }
  return randomBytes(32);
}

/** Values signed with a secret: `<base64url text>.<base64url HMAC-SHA256>`. */
export class SignedValues {
  readonly #secret: Buffer;

  constructor(secret: Buffer) {
    this.#secret = secret;
  }

  #mac(payload: string): Buffer {
    return createHmac('sha256', this.#secret).update(payload).digest();
  }

  /** The signed value carrying `text`. */
  sign(text: string): string {
    const payload = Buffer.from(text, 'utf8').toString('base64url');
    return `${payload}.${this.#mac(payload).toString('base64url')}`;
  }

  /** The text a value carries, or undefined when it is malformed, empty or its signature is wrong. */
  verify(value: string): string | undefined {
    const dot = value.indexOf('.');
    if (dot <= 0) return undefined;
    const payload = value.slice(0, dot);
    const given = Buffer.from(value.slice(dot + 1), 'base64url');
    const expected = this.#mac(payload);
    if (given.length !== expected.length || !timingSafeEqual(given, expected)) return undefined;
    const text = Buffer.from(payload, 'base64url').toString('utf8');
    return text === '' ? undefined : text;
  }
}

/**
 * On a worker of a server with several workers the signed text is `<routing id>.<session id>`
 * (core's `ownedName`): the cookie names the worker that owns the session, for the router.
 */
export class SessionCookie {
  readonly name: string;
  readonly #values: SignedValues;
  readonly #owner: string | undefined;

  constructor(serverName: string, secret: Buffer, owner?: string) {
    this.name = sessionCookieName(serverName);
    this.#values = new SignedValues(secret);
    this.#owner = owner;
  }

  /** The cookie value naming `sessionId` (and this worker, when it has a routing id). */
  sign(sessionId: string): string {
    return this.#values.sign(ownedName({ id: sessionId, owner: this.#owner }));
  }

  /** The session a value names, or undefined when it is malformed or its signature is wrong. */
  verifyRef(value: string): SessionRef | undefined {
    const text = this.#values.verify(value);
    return text === undefined ? undefined : parseOwnedName(text);
  }

  /** The session id a value names, or undefined when it is malformed or its signature is wrong. */
  verify(value: string): string | undefined {
    return this.verifyRef(value)?.id;
  }

  /** The session (and its owner) of a request's `Cookie` header, if it carries a valid one. */
  readRef(cookieHeader: string | undefined): SessionRef | undefined {
    if (!cookieHeader) return undefined;
    for (const part of cookieHeader.split(';')) {
      const eq = part.indexOf('=');
      if (eq < 0 || part.slice(0, eq).trim() !== this.name) continue;
      const ref = this.verifyRef(safeDecode(part.slice(eq + 1).trim()));
      if (ref !== undefined) return ref;
    }
    return undefined;
  }

  /** The session id of a request's `Cookie` header, if it carries a valid one. */
  read(cookieHeader: string | undefined): string | undefined {
    return this.readRef(cookieHeader)?.id;
  }

  /** A `Set-Cookie` value for `sessionId`. */
  header(sessionId: string): string {
    return `${this.name}=${encodeURIComponent(this.sign(sessionId))}; Path=/; HttpOnly; SameSite=Lax`;
  }
}

function safeDecode(value: string): string {
  try {
    return decodeURIComponent(value);
  } catch {
    return '';
  }
}

export function newSessionId(): string {
  return randomUUID();
}
