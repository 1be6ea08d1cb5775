/**
 * Simple Agent against a real resources server (the weather example): a session's direct HTTP
 * tool calls after a restore of both servers reach the restored resources session under the
 * replacement attempt's prefix.
 */
import { join } from 'node:path';

import { createLogger, listen, type ListeningServer } from '@ckpt-gym/core/server';
import { createResourcesServer, weatherServer } from '@ckpt-gym/resources-server';
import { deadline, ep } from '@ckpt-gym/testing';

import {
  activate,
  CHECKPOINT,
  control,
  type Harness,
  post,
  seed,
  startAgent,
  startStack,
} from './support/harness.js';

const quiet = () => createLogger({ level: 'error' });

interface Running {
  listening: ListeningServer;
  dispose(): void;
}

async function startWeather(port = 0): Promise<Running> {
  const server = createResourcesServer(weatherServer(), {
    name: 'weather',
    checkpoint: CHECKPOINT,
    logger: quiet(),
  });
  const listening = await listen(server.app, port);
  return { listening, dispose: () => server.plane?.dispose() };
}

async function stop(r: Running): Promise<void> {
  r.dispose();
  const closed = r.listening.close();
  r.listening.server.closeAllConnections();
  await closed;
}

let h: Harness;
const extra: Harness[] = [];
const weathers: Running[] = [];
afterEach(async () => {
  for (const x of extra.splice(0)) await x.close();
  for (const w of weathers.splice(0)) await stop(w);
  await h.close();
});

async function checkpointBoth(
  servers: { url: string }[],
  id: string,
  dir: string,
  scope: unknown[],
): Promise<void> {
  for (const s of servers) {
    const prepared = await control(s, 'prepare', { checkpoint_id: id, deadline_ts: deadline() });
    expect(prepared.body.phase).toBe('prepared');
  }
  for (const s of servers) {
    const committed = await control(s, 'commit', {
      checkpoint_id: id,
      checkpoint_dir: dir,
      episode_ids: scope,
    });
    expect(committed.status).toBe(200);
  }
}

test('a restored session’s direct HTTP tool call reaches the restored resources session under the replacement’s prefix', async () => {
  h = await startStack();
  let weather = await startWeather();
  weathers.push(weather);
  const seeded = await post(`${weather.listening.url}/ng-rollout/r1/seed_session`, {
    resources_session_id: 'res-1',
    episode_id: ep('r1'),
    task_id: { taskset: 'weather', task_id: '1' },
    task_data: {},
  });
  expect(seeded.status).toBe(200);
  const [cookieName, cookieValue] = Object.entries(seeded.cookies)[0]!;
  const grant = {
    kind: 'direct_http',
    name: 'weather',
    required: true,
    base_url: `${weather.listening.url}/ng-rollout/r1`,
    cookies: { [cookieName]: cookieValue },
    headers: {},
  };
  const s = await seed(h, 'sess-1', 'r1', { tools: [grant] });
  const first = await activate(h, s, 'r1', 1);
  expect((first.body.output as { output?: string }[])[1]!.output).toContain('sunny');

  const dir = join(h.dir, 'c1');
  await checkpointBoth([h, weather.listening], 'c1', dir, [ep('r1')]);

  // Crash both; fresh processes (the resources server on its old port) restore the checkpoint.
  const port = weather.listening.port;
  await stop(weathers.pop()!);
  weather = await startWeather(port);
  weathers.push(weather);
  const next = await startAgent({ model: h.model, resources: h.resources, dir: h.dir });
  extra.push(next);
  for (const server of [next, weather.listening]) {
    const restored = await control(server, 'restore', {
      checkpoint_id: 'c1',
      checkpoint_dir: dir,
      episode_ids: [ep('r1')],
    });
    expect(restored.status).toBe(200);
    await control(server, 'resume', { checkpoint_id: 'c1' });
  }

  const second = await activate(next, s, 'r1-a1', 2);
  expect(second.status).toBe(200);
  const toolOutput = (second.body.output as { type: string; output?: string }[]).find(
    (i) => i.type === 'function_call_output',
  )!.output!;
  expect(JSON.parse(toolOutput)).toEqual(
    expect.objectContaining({ forecast: expect.stringContaining('sunny') }),
  );
  // The replaced attempt's prefix is refused by the restored resources session.
  const stale = await post(
    `${weather.listening.url}/ng-rollout/r1/get_weather`,
    { city: 'SF' },
    {
      cookie: `${cookieName}=${cookieValue}`,
    },
  );
  expect(stale.status).toBe(409);
});
