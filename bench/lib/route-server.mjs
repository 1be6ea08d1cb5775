/* global process */
// The server `tracing-route` forks: a gym app (no checkpointing, logging at warn) with one route,
// `POST /echo`, that reads a JSON body and answers a small one after a turn of the event loop's
// promise queue. Tracing follows the OTEL_* variables as a gym server's does; the traced one gets
// the bench's rollout sample ratio. Sends `{ port }` to its parent once it listens.
import { startTracingFor } from '@ckpt-gym/core/client';
import { createGymApp, createLogger, gymRoute, listen, mountRoutes } from '@ckpt-gym/core/server';

const ratio = process.env.ROUTE_SERVER_SAMPLE_RATIO;
const who = { service: 'tracing-route', instance: 'route' };
startTracingFor(who, ratio ? { rolloutSampleRatio: Number(ratio) } : undefined);

const logger = createLogger({ server: 'route', kind: 'resources', level: 'warn' });
const gym = createGymApp({ name: 'route', kind: 'resources', logger });
mountRoutes(gym.app, [
  gymRoute({
    method: 'post',
    path: '/echo',
    episode: 'none',
    body: { limit: '1mb', parse: (body) => body },
    run: async (ctx) => {
      await Promise.resolve();
      return { ok: true, rollout: ctx.body.rollout ?? null };
    },
  }),
]);
const server = await listen(gym.finish(), 0, '127.0.0.1');
process.send({ port: server.port });
process.on('SIGTERM', () => void server.close().then(() => process.exit(0)));
