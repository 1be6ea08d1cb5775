import type { AddressInfo } from 'node:net';
import type { Server } from 'node:http';
import { networkInterfaces } from 'node:os';

import express, { type Request, type Response } from 'express';

import { ConfigError } from '../src/errors.js';
import { tcpKeepAliveTimerOn } from '../src/testing/tcp-timers.js';
import {
  ControlHttpError,
  ControlReplyError,
  ControlTimeoutError,
  createHttpClients,
  getControl,
  isLoopbackAddress,
  postControl,
  type HttpClients,
} from '../src/http-client.js';

interface Seen {
  path: string;
  body: Buffer;
  headers: Request['headers'];
}

/** A loopback server: `/hang` never replies, `/reply/<status>` answers with the body given per status. */
async function startServer(
  replies: Record<string, { status: number; body: string }> = {},
  host = '127.0.0.1',
) {
  const seen: Seen[] = [];
  const hanging: Response[] = [];
  const app = express();
  app.use(express.raw({ type: () => true }));
  app.all('/hang', (req, res) => {
    seen.push({ path: req.path, body: req.body as Buffer, headers: req.headers });
    hanging.push(res);
  });
  app.all('/reply/:name', (req, res) => {
    seen.push({ path: req.path, body: req.body as Buffer, headers: req.headers });
    const reply = replies[req.params.name as string] ?? { status: 200, body: '{"ok":true}' };
    res.status(reply.status).type('application/json').send(reply.body);
  });
  const server: Server = await new Promise((resolve) => {
    const s = app.listen(0, host, () => resolve(s));
  });
  const url = `http://${host}:${(server.address() as AddressInfo).port}`;
  return {
    url,
    seen,
    hanging,
    close: async () => {
      server.closeAllConnections();
      await new Promise((resolve) => server.close(resolve));
    },
  };
}

let clients: HttpClients | undefined;
let server: Awaited<ReturnType<typeof startServer>> | undefined;

afterEach(async () => {
  clients?.close();
  await server?.close();
  clients = undefined;
  server = undefined;
});

test('a control request completes while parked data calls hold every data connection to the host', async () => {
  server = await startServer();
  clients = createHttpClients({
    data: { maxSockets: 2, maxTotalSockets: 2 },
    control: { maxSockets: 2, maxTotalSockets: 2 },
  });
  const data = clients.data;
  const parked = [data.post(`${server.url}/hang`), data.post(`${server.url}/hang`)];
  while (server.hanging.length < 2) await new Promise((resolve) => setTimeout(resolve, 10));
  // The data pool is full: a third data call to the host queues in the agent.
  const queued = data.get(`${server.url}/reply/queued`);
  for (const call of [...parked, queued]) call.catch(() => {});

  const reply = await postControl(clients.control, `${server.url}/reply/ok`, Buffer.from('{}'), {
    token: 't',
    timeoutMs: 5_000,
  });
  expect(reply).toEqual({ ok: true });
  expect(server.seen.map((request) => request.path)).toEqual(['/hang', '/hang', '/reply/ok']);
});

test('a control call queued behind a full pool still times out', async () => {
  server = await startServer();
  clients = createHttpClients({ control: { maxSockets: 1, maxTotalSockets: 1 } });
  const parked = postControl(clients.control, `${server.url}/hang`, Buffer.from('{}'), {
    token: 't',
  });
  parked.catch(() => {});
  while (server.hanging.length < 1) await new Promise((resolve) => setTimeout(resolve, 10));
  await expect(
    postControl(clients.control, `${server.url}/reply/ok`, Buffer.from('{}'), {
      token: 't',
      timeoutMs: 200,
    }),
  ).rejects.toThrow(ControlTimeoutError);
});

test('postControl sends the bearer token, JSON content type and the given bytes, and parses the reply', async () => {
  server = await startServer();
  clients = createHttpClients();
  const body = Buffer.from('{"checkpoint_id":"c1","deadline_ts":1}');
  const reply = await postControl(clients.control, `${server.url}/reply/ok`, body, {
    token: 'secret',
  });
  expect(reply).toEqual({ ok: true });
  const [request] = server.seen;
  expect(request?.headers.authorization).toBe('Bearer secret');
  expect(request?.headers['content-type']).toBe('application/json');
  expect(request?.body.equals(body)).toBe(true);
});

test('a non-200 reply is a ControlHttpError built from the error body', async () => {
  server = await startServer({
    refused: {
      status: 409,
      body: '{"error":{"code":"invalid_phase","detail":"prepare is not valid in committed"}}',
    },
  });
  clients = createHttpClients();
  const call = postControl(clients.control, `${server.url}/reply/refused`, Buffer.from('{}'), {
    token: 't',
  });
  await expect(call).rejects.toThrow(ControlHttpError);
  await expect(call).rejects.toMatchObject({
    status: 409,
    code: 'invalid_phase',
    message: 'HTTP 409 invalid_phase prepare is not valid in committed',
  });
});

test("a refusal's code is typed only when the catalogue defines it; another code stays in the message", async () => {
  server = await startServer({
    foreign: { status: 409, body: '{"error":{"code":"no_such_code","detail":"from elsewhere"}}' },
  });
  clients = createHttpClients();
  const call = getControl(clients.control, `${server.url}/reply/foreign`, { token: 't' });
  await expect(call).rejects.toThrow(ControlHttpError);
  await expect(call).rejects.toMatchObject({
    status: 409,
    code: undefined,
    detail: 'from elsewhere',
    message: 'HTTP 409 no_such_code from elsewhere',
  });
});

test('a non-200 reply without the error shape names the first 200 bytes of its body', async () => {
  const text = `"${'x'.repeat(300)}"`;
  server = await startServer({ broken: { status: 500, body: text } });
  clients = createHttpClients();
  const call = getControl(clients.control, `${server.url}/reply/broken`, { token: 't' });
  await expect(call).rejects.toMatchObject({
    status: 500,
    code: undefined,
    message: `HTTP 500 ${text.slice(0, 200)}`,
  });
});

test('a 200 reply that is not a JSON object is a ControlReplyError', async () => {
  server = await startServer({ list: { status: 200, body: '[1,2]' } });
  clients = createHttpClients();
  await expect(
    getControl(clients.control, `${server.url}/reply/list`, { token: 't' }),
  ).rejects.toThrow(ControlReplyError);
});

test('control calls are never retried by the client', async () => {
  server = await startServer({ busy: { status: 503, body: '{}' } });
  clients = createHttpClients();
  await expect(
    getControl(clients.control, `${server.url}/reply/busy`, { token: 't' }),
  ).rejects.toThrow(ControlHttpError);
  expect(server.seen).toHaveLength(1);
});

test('a control call is bounded by its timeout', async () => {
  server = await startServer();
  clients = createHttpClients();
  await expect(
    postControl(clients.control, `${server.url}/hang`, Buffer.from('{}'), {
      token: 't',
      timeoutMs: 200,
    }),
  ).rejects.toThrow(new ControlTimeoutError(`${server.url}/hang`, 200));
});

test.each([
  ['a negative control limit', { control: { maxSockets: -1, maxTotalSockets: 256 } }],
  ['a negative data limit', { data: { maxSockets: 4, maxTotalSockets: -5 } }],
  ['a fractional limit', { control: { maxSockets: 1.5, maxTotalSockets: 256 } }],
])('%s is refused with a ConfigError', (_name, limits) => {
  expect(() => createHttpClients(limits)).toThrow(ConfigError);
});

test('0 and Infinity are accepted as unlimited (node refuses a socket limit of 0)', () => {
  const limits = {
    data: { maxSockets: 0, maxTotalSockets: Infinity },
    control: { maxSockets: Infinity, maxTotalSockets: 0 },
  };
  expect(() => createHttpClients(limits).close()).not.toThrow();
});

test.each([
  ['127.0.0.1', true],
  ['127.3.2.1', true],
  ['::1', true],
  ['::ffff:127.0.0.1', true],
  ['10.0.0.5', false],
  ['::ffff:10.0.0.5', false],
  ['fe80::1', false],
  [undefined, false],
])('%s is a loopback address: %s', (address, loopback) => {
  expect(isLoopbackAddress(address)).toBe(loopback);
});

// --- TCP keep-alive probes, read from the kernel's socket table -----------------------------------

/** Whether a held data call's connection probes, and the same connection pooled after its reply. */
async function probeTimers(host: string): Promise<{ held?: boolean; pooled?: boolean }> {
  server = await startServer({}, host);
  clients = createHttpClients();
  const call = clients.data.post(`${server.url}/hang`, { body: '{}' });
  while (server.hanging.length === 0) await new Promise((resolve) => setTimeout(resolve, 10));
  const socket = server.hanging[0]!.socket!;
  const ports = [socket.remotePort!, socket.localPort!] as const;
  const held = tcpKeepAliveTimerOn(...ports);
  server.hanging[0]!.json({ ok: true });
  await call;
  return { held, pooled: tcpKeepAliveTimerOn(...ports) };
}

const onLinux = process.platform === 'linux' ? test : test.skip;

onLinux(
  'a data connection to a loopback peer sends no TCP keep-alive probes, held or pooled',
  async () => {
    const { held, pooled } = await probeTimers('127.0.0.1');
    expect({ held, pooled }).toEqual({ held: false, pooled: false });
  },
);

const outsideAddress = Object.values(networkInterfaces())
  .flat()
  .find((a) => a?.family === 'IPv4' && !a.internal && !isLoopbackAddress(a.address))?.address;

(outsideAddress === undefined ? test.skip : onLinux)(
  'a data connection to a peer at a non-loopback address keeps its TCP keep-alive probes',
  async () => {
    const { held, pooled } = await probeTimers(outsideAddress!);
    expect({ held, pooled }).toEqual({ held: true, pooled: true });
  },
);
