import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { ConfigError } from '@ckpt-gym/core/protocol';
import { parseStackFile, startServerMain } from '@ckpt-gym/core/server';
import { stubAgent, stubResources, type StubServer } from '@ckpt-gym/testing';
import got from 'got';

import { environmentConfig } from '../src/config.js';
import { environmentKind } from '../src/kind.js';
import { environmentServerFromStack } from '../src/registry.js';
import { runBody } from './support/harness.js';

function stack(
  envEntry: string,
  ports = { agent: 9001, resources: 9002 },
  checkpoint = false,
): string {
  return [
    checkpoint ? 'checkpoint: { enabled: true, control_auth_token: tok }' : '',
    'servers:',
    `  agent:     { kind: agent, app: simple, port: ${ports.agent}, model_server: policy, resources_server: weather }`,
    '  policy:    { kind: model, app: policy, port: 9003, backend_url: "http://127.0.0.1:9004/v1" }',
    `  weather:   { kind: resources, app: weather, port: ${ports.resources} }`,
    `  env:       { kind: environment, port: 0, agent_server: agent, resources_server: weather, ${envEntry} }`,
  ].join('\n');
}

function env(envEntry: string) {
  return parseStackFile(stack(envEntry)).servers.get('env')!;
}

describe('the environment entry of a stack file', () => {
  it('takes the app and its keys', () => {
    const config = environmentConfig(
      env(
        'app: single_agent_turn_legacy, max_concurrent_episodes: 4, queue_timeout_seconds: 2, episode_deadline_seconds: 60',
      ),
    );
    expect(config).toEqual({
      app: 'single_agent_turn_legacy',
      agentServer: 'agent',
      resourcesServer: 'weather',
      queue: { maxConcurrentEpisodes: 4, queueTimeoutSeconds: 2 },
      episodeDeadlineSeconds: 60,
      cleanupTimeoutSeconds: 60,
      toolTransports: ['direct_http'],
    });
  });

  it.each([
    ['an unknown app', 'app: multi_turn'],
    [
      'max_concurrent_episodes without queue_timeout_seconds',
      'app: single_agent_turn, max_concurrent_episodes: 2',
    ],
    ['a zero episode deadline', 'app: single_agent_turn, episode_deadline_seconds: 0'],
    ['an unknown tool transport', 'app: single_agent_turn, resources_tool_transports: [grpc]'],
  ])('refuses %s', (_what, entry) => {
    expect(() => environmentConfig(env(entry))).toThrow(ConfigError);
  });

  it('refuses to build a server of another kind', () => {
    expect(() =>
      environmentServerFromStack(parseStackFile(stack('app: single_agent_turn')), 'weather'),
    ).toThrow(/not environment/);
  });
});

describe('the CLI', () => {
  let dir = '';
  let agent: StubServer;
  let resources: StubServer;
  beforeEach(async () => {
    dir = await mkdtemp(join(tmpdir(), 'env-cli-'));
    agent = stubAgent();
    resources = stubResources();
    await agent.start();
    await resources.start();
  });
  afterEach(async () => {
    await agent.stop();
    await resources.stop();
    await rm(dir, { recursive: true, force: true });
  });

  it('starts the named server from a stack file, prints a listening line, serves /run and stops', async () => {
    const file = join(dir, 'stack.yaml');
    const port = (s: StubServer) => Number(new URL(s.url).port);
    await writeFile(
      file,
      stack('app: single_agent_turn', { agent: port(agent), resources: port(resources) }, true),
    );
    const lines: string[] = [];
    const cli = await startServerMain(
      environmentKind,
      ['--config', file, '--server', 'env'],
      (l) => void lines.push(l),
    );
    try {
      const listening = JSON.parse(lines[0]!) as Record<string, unknown>;
      expect(listening).toMatchObject({
        event: 'listening',
        server: 'env',
        kind: 'environment',
        app: 'single_agent_turn',
        checkpointing: true,
        url: cli.url,
      });
      const reply = await got.post(`${cli.url}/run`, { json: runBody('r1') }).json();
      expect(reply).toMatchObject({ result: { reward: 1 } });
      expect(resources.calls[0]!.key).toBe('r1');
    } finally {
      await cli.close();
    }
  });

  it('refuses to start without --config and --server', async () => {
    await expect(startServerMain(environmentKind, [])).rejects.toThrow(/usage/);
  });
});
