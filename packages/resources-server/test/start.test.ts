import { writeFile } from 'node:fs/promises';
import { join } from 'node:path';

import { type Env, type GymServer, kindSchemas, loadStackFile } from '@ckpt-gym/core/server';

import { resourcesKind } from '../src/index.js';
import { cleanUp, SilentLogger, tempDir } from './support.js';

/** What `ckpt-gym serve` and the package's bin do: load the file with the kind's schema, start. */
async function startFromStackFile(
  path: string,
  name: string,
  options: { env?: Env; logger?: SilentLogger } = {},
): Promise<GymServer> {
  const stack = loadStackFile(path, options.env, kindSchemas([resourcesKind]));
  return resourcesKind.fromStack(stack, name, { logger: options.logger });
}

const started: GymServer[] = [];
afterEach(async () => {
  await Promise.all(started.splice(0).map((s) => s.close()));
  await cleanUp();
});

async function stackFile(body: string): Promise<string> {
  const path = join(await tempDir(), 'stack.yaml');
  await writeFile(path, body);
  return path;
}

describe('starting from the stack file', () => {
  test('a server named in the stack file listens with its app and the checkpoint block', async () => {
    const path = await stackFile(
      [
        'checkpoint: { enabled: true, control_auth_token: "${TOKEN}" }',
        'servers:',
        '  counter: { kind: resources, app: counter, port: 0 }',
      ].join('\n'),
    );
    const server = await startFromStackFile(path, 'counter', {
      env: { TOKEN: 'secret' },
      logger: new SilentLogger(),
    });
    started.push(server);
    const status = await fetch(`${server.url}/ng-control/v1/checkpoint/status`, {
      headers: { authorization: 'Bearer secret' },
    });
    expect(await status.json()).toMatchObject({ instance: 'counter', mode: 'exported' });
    const seed = await fetch(`${server.url}/ng-rollout/r1/seed_session`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: '{}',
    });
    expect(seed.headers.get('x-ng-checkpoint-verify')).toBe('wait');
  });

  test('an unknown server, a non-resources server and a bad session_secret fail before listening', async () => {
    const path = await stackFile(
      ['servers:', '  inference: { kind: inference, app: fake, port: 0 }'].join('\n'),
    );
    await expect(startFromStackFile(path, 'nope')).rejects.toThrow(/no server named 'nope'/);
    await expect(startFromStackFile(path, 'inference')).rejects.toThrow(/not 'resources'/);
    // The session_secret is checked when the file is loaded.
    const weird = await stackFile(
      ['servers:', '  weird: { kind: resources, app: weather, port: 0, session_secret: 3 }'].join(
        '\n',
      ),
    );
    await expect(startFromStackFile(weird, 'weird')).rejects.toThrow(/session_secret/);
  });

  test("a configured session_secret signs the cookie, so a second process accepts the first one's cookie", async () => {
    const path = await stackFile(
      ['servers:', '  c: { kind: resources, app: counter, port: 0, session_secret: s3cret }'].join(
        '\n',
      ),
    );
    const one = await startFromStackFile(path, 'c', { logger: new SilentLogger() });
    started.push(one);
    const seed = await fetch(`${one.url}/seed_session`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: '{"initial_count": 9}',
    });
    const cookie = (seed.headers.get('set-cookie') ?? '').split(';')[0] as string;
    const two = await startFromStackFile(path, 'c', { logger: new SilentLogger() });
    started.push(two);
    const again = await fetch(`${two.url}/get_counter_value`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', cookie },
      body: '{}',
    });
    // The second process has no counter for it, but it kept the session (no new cookie).
    expect(again.headers.get('set-cookie')).toBeNull();
  });
});
