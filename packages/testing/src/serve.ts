/** A server on a free loopback port that `await using` closes, connections and all. */
import { listen, type ListeningServer } from '@ckpt-gym/core/server';
import type { Express } from 'express';

export interface DisposableServer extends ListeningServer, AsyncDisposable {}

/**
 * Closes `server` as a torn-down process would: connections a test abandoned mid-request end
 * with it, so no handler outlives the test.
 */
export async function closeNow(server: ListeningServer): Promise<void> {
  const closed = server.close();
  server.server.closeAllConnections();
  await closed;
}

/** Listens on port 0 with core's `listen` (the servers' own connection settings). */
export async function serve(app: Express): Promise<DisposableServer> {
  const server = await listen(app, 0);
  return { ...server, [Symbol.asyncDispose]: () => closeNow(server) };
}
