/**
 * docker-compose.yml against the stack file it runs: every server a service, each with a
 * healthcheck and its port published on loopback; and the Dockerfile's layer order.
 */
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { basename, join } from 'node:path';

import { parse } from 'yaml';

import {
  healthUrl,
  launchOrder,
  loadStack,
  SERVER_GLIBC_TUNABLE,
  SERVER_NODE_FLAGS,
} from '../src/index.js';
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
  ports?: string[];
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
    const url = healthUrl(`http://${name}:${server.port}`);
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

test("the image runs every node process with the launcher's server flags and malloc tunable", () => {
  const dockerfile = readFileSync(join(REPO, 'Dockerfile'), 'utf8');
  const runtime = dockerfile.slice(dockerfile.indexOf(' AS runtime'));
  expect(/^ENV NODE_OPTIONS=(.*)$/m.exec(runtime)?.[1]?.split(' ')).toEqual(SERVER_NODE_FLAGS);
  expect(/^ENV GLIBC_TUNABLES=(.*)$/m.exec(runtime)?.[1]).toBe(SERVER_GLIBC_TUNABLE);
});

test("every server's port is published on 127.0.0.1, the same port on the host", () => {
  for (const name of launchOrder(stack)) {
    const { port } = stack.servers.get(name)!;
    expect([name, compose.services[name]?.ports]).toEqual([name, [`127.0.0.1:${port}:${port}`]]);
  }
});

/** The instructions of one stage of a Dockerfile (`FROM … AS name` to the next FROM), joined. */
function dockerStage(dockerfile: string, name: string): string[] {
  const instructions = dockerfile
    .replace(/\\\n/g, ' ')
    .split('\n')
    .map((line) => line.trim())
    .filter((line) => line !== '' && !line.startsWith('#'));
  const start = instructions.findIndex((line) =>
    new RegExp(`^FROM .* AS ${name}$`, 'i').test(line),
  );
  if (start < 0) throw new Error(`no stage ${name}`);
  const end = instructions.findIndex((line, i) => i > start && /^FROM /i.test(line));
  return instructions.slice(start + 1, end < 0 ? undefined : end);
}

/** The sources of a `COPY [--flags] a b … dest`. */
function copySources(instruction: string): string[] {
  const words = instruction
    .split(/\s+/)
    .slice(1)
    .filter((word) => !word.startsWith('--'));
  return words.slice(0, -1);
}

const MANIFEST = /^(package\.json|package-lock\.json|tsconfig[\w.-]*\.json)$/;

/** Every workspace of the root package.json, as a directory relative to the repository. */
function workspaces(): string[] {
  const root = JSON.parse(readFileSync(join(REPO, 'package.json'), 'utf8')) as {
    workspaces: string[];
  };
  return root.workspaces.flatMap((pattern) => {
    if (!pattern.endsWith('/*')) return [pattern];
    const parent = pattern.slice(0, -2);
    return readdirSync(join(REPO, parent))
      .filter((dir) => existsSync(join(REPO, parent, dir, 'package.json')))
      .map((dir) => `${parent}/${dir}`);
  });
}

test('the build stage runs npm ci on the manifests of every workspace before it copies any source', () => {
  const stage = dockerStage(readFileSync(join(REPO, 'Dockerfile'), 'utf8'), 'build');
  const install = stage.findIndex((line) => /^RUN npm ci\b/.test(line));
  expect(install).toBeGreaterThan(0);
  const before = stage.slice(0, install).filter((line) => /^COPY /.test(line));
  const copied = before.flatMap(copySources);
  // Only manifests before the install: a source change must not invalidate its layer.
  expect(copied.filter((source) => !MANIFEST.test(basename(source)))).toEqual([]);
  for (const dir of workspaces()) expect(copied).toContain(`${dir}/package.json`);
  expect(copied).toEqual(expect.arrayContaining(['package-lock.json']));
  // The sources come after it, and the compile after them.
  const after = stage.slice(install + 1);
  const sources = after.findIndex((line) => /^COPY packages\/ /.test(line));
  const compile = after.findIndex((line) => /\btsc\b/.test(line));
  expect(sources).toBeGreaterThanOrEqual(0);
  expect(compile).toBeGreaterThan(sources);
});
