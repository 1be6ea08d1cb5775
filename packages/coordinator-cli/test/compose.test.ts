/** docker-compose.yml against the stack file it runs: every server a service, each with a healthcheck. */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';

import { parse } from 'yaml';

import { healthUrl, launchOrder, loadStack, SERVER_NODE_FLAGS } from '../src/index.js';
import { REPO } from './support/build.js';

const STACK_IN_IMAGE = '/app/examples/compose.yaml';

interface Service {
  command: string[];
  init?: boolean;
  stop_grace_period?: string;
  environment?: Record<string, string>;
  volumes?: string[];
  depends_on?: Record<string, { condition: string }>;
  healthcheck?: { test: string[] };
}

const compose = parse(readFileSync(join(REPO, 'docker-compose.yml'), 'utf8'), { merge: true }) as {
  services: Record<string, Service>;
};
const stack = loadStack(join(REPO, 'examples/compose.yaml'), { CKPT_GYM_TOKEN: 'test' });
const services = Object.entries(compose.services);

test('every service runs `serve` of a server of the compose stack file, and every server has one', () => {
  for (const [name, service] of services) {
    expect([name, service.command]).toEqual([
      name,
      ['serve', '--config', STACK_IN_IMAGE, '--server', name],
    ]);
    expect(stack.servers.has(name)).toBe(true);
  }
  expect(services.map(([name]) => name).sort()).toEqual(launchOrder(stack).sort());
});

test("every service has a healthcheck on its server's health route, at its own hostname", () => {
  for (const [name, service] of services) {
    const server = stack.servers.get(name)!;
    expect(server.host).toBe(name);
    const url = healthUrl(server.kind, `http://${name}:${server.port}`);
    expect([name, service.healthcheck?.test.join(' ')]).toEqual([
      name,
      expect.stringContaining(`'${url}'`),
    ]);
  }
});

test('a service starts once the servers it calls are healthy', () => {
  for (const [name, service] of services) {
    const config = stack.servers.get(name)!.config;
    const calls = ['model_server', 'resources_server', 'agent_server']
      .map((key) => config[key])
      .filter((callee): callee is string => typeof callee === 'string');
    const backend = typeof config.backend_url === 'string' ? ['inference'] : [];
    for (const callee of [...calls, ...backend]) {
      expect([name, service.depends_on?.[callee]]).toEqual([
        name,
        { condition: 'service_healthy' },
      ]);
    }
  }
});

test('every service has init, a stop grace period, the shared volume and the token from the environment', () => {
  for (const [name, service] of services) {
    expect([name, service.init, typeof service.stop_grace_period]).toEqual([name, true, 'string']);
    expect(service.volumes).toContain('ckpt-data:/data');
    expect(service.environment?.CKPT_GYM_TOKEN).toMatch(/^\$\{CKPT_GYM_TOKEN/);
  }
  expect(stack.tokenCapture.dir.startsWith('/data/')).toBe(true);
});

test("the image runs every node process with the launcher's server flags", () => {
  const dockerfile = readFileSync(join(REPO, 'Dockerfile'), 'utf8');
  const runtime = dockerfile.slice(dockerfile.indexOf(' AS runtime'));
  expect(/^ENV NODE_OPTIONS=(.*)$/m.exec(runtime)?.[1]?.split(' ')).toEqual(SERVER_NODE_FLAGS);
});
