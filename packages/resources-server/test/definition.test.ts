import { ConfigError } from '@ckpt-gym/core/protocol';

import {
  checkDefinition,
  createResourcesServer,
  exactMatchServer,
  multipleChoiceServer,
  numericMatchServer,
  type ResourcesServerDefinition,
} from '../src/index.js';
import { probeServer } from './probe.js';
import { SilentLogger, TOKEN } from './support.js';

const checkpoint = { enabled: true as const, controlAuthToken: TOKEN, leaseGraceSeconds: 600 };

function build(def: ResourcesServerDefinition, on: boolean, extra: { mcp?: boolean } = {}) {
  return createResourcesServer(def, {
    name: 'res',
    checkpoint: on ? checkpoint : undefined,
    logger: new SilentLogger(),
    exposeToolsOverMcp: extra.mcp,
  });
}

describe('startup checks', () => {
  test.each([true, false])(
    'an unknown checkpoint_mode fails at startup, naming the attribute, value and allowed values (checkpointing %s)',
    (on) => {
      const def = { ...probeServer(), checkpointMode: 'exportd' };
      expect(() => build(def, on)).toThrow(ConfigError);
      expect(() => build(def, on)).toThrow(
        /checkpoint_mode "exportd" is not one of "restart_only", "stateless", "exported"/,
      );
    },
  );

  test.each([true, false])(
    'an unknown checkpoint_verify fails at startup (checkpointing %s)',
    (on) => {
      const def = { ...probeServer(), checkpointVerify: 'replayy' };
      expect(() => build(def, on)).toThrow(
        /checkpoint_verify "replayy" is not one of "wait", "replay"/,
      );
    },
  );

  test('the declarations default to restart_only, wait and /seed_session', () => {
    const declared = checkDefinition({ app: 'plain', tools: {}, verify: () => ({ reward: 0 }) });
    expect(declared.mode).toBe('restart_only');
    expect(declared.verify).toBe('wait');
    expect(declared.sessionStarts).toEqual(['/seed_session']);
  });

  test.each(['exportSessionStates', 'restoreSessionStates', 'retireSessionState'] as const)(
    'an exported server without %s fails at startup',
    (hook) => {
      const probe = probeServer('exported');
      const hooks = { ...probe.hooks };
      delete hooks[hook];
      const def = { ...probe, hooks };
      expect(() => build(def, false)).toThrow(new RegExp(`does not implement ${hook}`));
    },
  );

  test('hooks inherited from a base object count', () => {
    const probe = probeServer('exported');
    const hooks = Object.create(probe.hooks ?? null) as typeof probe.hooks;
    expect(() => build({ ...probe, hooks }, true)).not.toThrow();
  });

  test('a declared session start that is not a route fails at startup', () => {
    const def = { ...probeServer(), sessionStarts: ['/seed_session', '/nowhere'] };
    expect(() => build(def, false)).toThrow(/declared session start '\/nowhere'/);
  });

  test('a tool with a reserved name fails at startup', () => {
    const def = { ...probeServer(), tools: { verify: () => ({}) } };
    expect(() => build(def, false)).toThrow(/tool 'verify' uses a reserved name/);
  });

  test.each([true, false])(
    'a server configured to expose tools over MCP starts (checkpointing %s)',
    (on) => {
      expect(() => build(probeServer(), on, { mcp: true })).not.toThrow();
      expect(() => build(probeServer(), on, { mcp: false })).not.toThrow();
    },
  );
});

describe('verifier declarations', () => {
  test.each([
    ['exact_match', exactMatchServer],
    ['multiple_choice', multipleChoiceServer],
    ['numeric_match', numericMatchServer],
  ])('%s declares stateless with replay verification', (_name, factory) => {
    const declared = checkDefinition(factory());
    expect([declared.mode, declared.verify]).toEqual(['stateless', 'replay']);
  });
});
