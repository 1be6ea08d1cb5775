import { connect } from 'node:net';

import express from 'express';

import { controlClient, serve, startStubModel, stubAgent, until } from '../src/index.js';

/** True when something accepts a connection on `port`. */
function accepts(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = connect(port, '127.0.0.1');
    socket.once('connect', () => {
      socket.destroy();
      resolve(true);
    });
    socket.once('error', () => resolve(false));
  });
}

test('a served app closes its port, and ends a request in flight, when its scope ends', async () => {
  let port = 0;
  let inFlight: Promise<unknown> = Promise.resolve();
  let arrived = false;
  {
    const app = express();
    app.get('/hang', () => void (arrived = true)); // never replies
    await using server = await serve(app);
    port = server.port;
    expect(await accepts(port)).toBe(true);
    inFlight = fetch(`${server.url}/hang`).catch((err: unknown) => err);
    await until(() => arrived, 'the request to arrive');
  }
  expect(await accepts(port)).toBe(false);
  expect(String(await inFlight)).toContain('fetch failed');
});

test('the stub servers close their ports when their scope ends', async () => {
  const ports: number[] = [];
  {
    await using model = await startStubModel();
    await using agent = stubAgent();
    await agent.start();
    ports.push(Number(new URL(model.url).port), Number(new URL(agent.url).port));
    for (const port of ports) expect(await accepts(port)).toBe(true);
  }
  for (const port of ports) expect(await accepts(port)).toBe(false);
});

test('the control client sends the bearer and returns replies of any status', async () => {
  const app = express();
  app.use(express.json());
  app.post('/ng-control/v1/checkpoint/:route', (req, res) => {
    if (req.headers.authorization !== 'Bearer tok') {
      res.status(401).json({ error: { code: 'unauthorized', detail: 'no' } });
      return;
    }
    res.json({ route: req.params.route, body: req.body as unknown });
  });
  await using server = await serve(app);
  await using good = controlClient(server.url, 'tok');
  await using bad = controlClient(server.url, 'nope');
  expect(await bad.post('prepare', {})).toEqual({
    status: 401,
    body: { error: { code: 'unauthorized', detail: 'no' } },
  });
  const sent = await good.resume('c1');
  expect(sent.route).toBe('resume');
  expect(sent.body).toEqual({ checkpoint_id: 'c1', deadline_ts: expect.any(Number) });
  await expect(bad.resume('c1')).rejects.toThrow('resume failed: 401');
  expect((await good.get('status')).status).toBe(404); // a GET route the app does not have
});
