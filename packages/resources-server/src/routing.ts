/**
 * How a resources request names its session, for the session router of a server with several
 * workers (core's `SessionRouter`): an MCP call by its token, anything else by its signed cookie
 * (or, without one, by a token). The names are read with the same secret the handlers use; a value
 * that does not verify names no session, so the request is served where it landed and refused or
 * given a new session there as in one process.
 */
import type { IncomingMessage } from 'node:http';

import type { SessionOf, SessionRef } from '@ckpt-gym/core/server';

import type { SessionCookie } from './cookie.js';
import { MCP_ROUTE } from './mcp.js';
import type { McpTokens } from './mcp-token.js';

function isMcpPath(url: string | undefined): boolean {
  const path = url?.split('?', 1)[0];
  return path === MCP_ROUTE || path?.startsWith(`${MCP_ROUTE}/`) === true;
}

function tokenSession(tokens: McpTokens | undefined, req: IncomingMessage): SessionRef | undefined {
  const authorization = req.headers.authorization;
  if (!tokens || authorization === undefined) return undefined;
  try {
    const claims = tokens.read(authorization);
    return { id: claims.session_id, owner: claims.owner };
  } catch {
    return undefined;
  }
}

export function resourcesSessionOf(
  cookie: SessionCookie,
  tokens: McpTokens | undefined,
): SessionOf {
  return (req) => {
    if (isMcpPath(req.url)) return tokenSession(tokens, req);
    return cookie.readRef(req.headers.cookie) ?? tokenSession(tokens, req);
  };
}
