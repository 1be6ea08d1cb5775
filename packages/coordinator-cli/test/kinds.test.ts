/** `serve` as a table over the server packages' kinds, and the stack file checked against them. */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';

import { ConfigError } from '@ckpt-gym/core/protocol';
import { SERVER_KINDS } from '@ckpt-gym/core/server';

import { KIND_SCHEMAS, SERVER_KIND_MODULES } from '../src/serve.js';
import { loadStack } from '../src/stack-file.js';

const EXAMPLES = resolve(import.meta.dirname, '../../../examples');

let dir = '';
beforeEach(() => (dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-kinds-'))));
afterEach(() => rmSync(dir, { recursive: true, force: true }));

function load(lines: string[]) {
  const path = join(dir, 'stack.yaml');
  writeFileSync(path, ['servers:', ...lines.map((line) => `  ${line}`)].join('\n'));
  return loadStack(path, {});
}

function refusal(lines: string[]): string {
  try {
    load(lines);
  } catch (err) {
    expect(err).toBeInstanceOf(ConfigError);
    return (err as Error).message;
  }
  throw new Error('the stack file was accepted');
}

const POLICY = 'policy: { kind: model, app: policy, port: 0, backend_url: "http://h:1/v1"';

describe("serve's table", () => {
  test('has a module for every kind, each of its own kind', () => {
    expect(Object.keys(SERVER_KIND_MODULES).sort()).toEqual([...SERVER_KINDS].sort());
    for (const [kind, module] of Object.entries(SERVER_KIND_MODULES))
      expect(module.kind).toBe(kind);
  });
});

describe('a stack file loaded by the CLI', () => {
  test('refuses a typo of a per-app key, suggesting the key', () => {
    const message = refusal([`${POLICY}, checkpoint_generation_cutz: true }`]);
    expect(message).toMatch(
      /: servers\.policy\.checkpoint_generation_cutz: unknown key \(allowed: .*\) \(did you mean 'checkpoint_generation_cuts'\?\)$/,
    );
  });

  test('refuses a per-app key of the wrong type and a key of another app', () => {
    expect(refusal([`${POLICY}, forward_rollout_prefix: "yes" }`])).toMatch(
      /: servers\.policy\.forward_rollout_prefix: must be boolean or null$/,
    );
    expect(refusal(['w: { kind: resources, app: weather, port: 0, flag_file: f }'])).toMatch(
      /servers\.w\.flag_file: unknown key/,
    );
  });

  test("leaves an external inference backend's keys to it", () => {
    expect(load(['vllm: { kind: inference, app: vllm, port: 8000, gpu: 0 }']).servers.size).toBe(1);
  });

  test.each(['local.yaml', 'compose.yaml'])('accepts the bundled examples/%s', (file) => {
    const stack = loadStack(join(EXAMPLES, file), { CKPT_GYM_TOKEN: 't' });
    expect(stack.servers.size).toBeGreaterThan(0);
    expect(KIND_SCHEMAS).toEqual(
      Object.fromEntries(
        SERVER_KINDS.map((kind) => [kind, SERVER_KIND_MODULES[kind].configSchema]),
      ),
    );
  });
});
