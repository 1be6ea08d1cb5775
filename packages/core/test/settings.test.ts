import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import { jest } from '@jest/globals';
import { Ajv } from 'ajv';

import { ConfigError } from '../src/errors.js';
import {
  type Env,
  type KindConfigSchemas,
  controlPoolLimits,
  dataPoolLimits,
  loadStackFile,
  parseStackFile,
  serverSettings,
  serverUrl,
  serversByKind,
} from '../src/settings.js';

const SOURCE = '/stacks/ckpt-gym.yaml';
const EXAMPLE = resolve(dirname(fileURLToPath(import.meta.url)), '../../../examples/local.yaml');

const MODEL =
  'policy: { kind: model, app: policy, port: 8101, backend_url: http://127.0.0.1:8100/v1 }';

/** A stack file from top-level blocks and server lines (each line one `name: {…}` entry). */
function stack(opts: { top?: string; servers?: string[] } = {}): string {
  const servers = opts.servers ?? [MODEL];
  return `${opts.top ?? ''}\nservers:\n${servers.map((line) => `  ${line}`).join('\n')}\n`;
}

function parse(text: string, env: Env = {}) {
  return parseStackFile(text, { env, source: SOURCE });
}

/** The ConfigError a bad file raises; fails the test when the file is accepted. */
function refusal(text: string, env: Env = {}): ConfigError {
  try {
    parse(text, env);
  } catch (err) {
    expect(err).toBeInstanceOf(ConfigError);
    expect((err as ConfigError).code).toBe('invalid_config');
    return err as ConfigError;
  }
  throw new Error('the stack file was accepted');
}

const CHECKPOINT_ON = 'checkpoint: { enabled: true, control_auth_token: tok }';

describe('interpolation', () => {
  it('substitutes a set variable', () => {
    const settings = parse(
      stack({ top: 'checkpoint:\n  enabled: true\n  control_auth_token: ${TOKEN}' }),
      {
        TOKEN: 'from-env',
      },
    );
    expect(settings.checkpoint?.controlAuthToken).toBe('from-env');
  });

  it('uses the default when the variable is unset or empty, and the variable when set', () => {
    const text = stack({
      top: 'checkpoint: { enabled: true, control_auth_token: "${TOKEN:-fallback}" }',
    });
    expect(parse(text, {}).checkpoint?.controlAuthToken).toBe('fallback');
    expect(parse(text, { TOKEN: '' }).checkpoint?.controlAuthToken).toBe('fallback');
    expect(parse(text, { TOKEN: 'set' }).checkpoint?.controlAuthToken).toBe('set');
  });

  it('substitutes inside a longer string', () => {
    const settings = parse(
      stack({
        servers: [
          'policy: { kind: model, app: policy, port: 8101, backend_url: "http://${HOST}:8100/v1" }',
        ],
      }),
      { HOST: '10.0.0.5' },
    );
    expect(serverSettings(settings, 'policy').config.backend_url).toBe('http://10.0.0.5:8100/v1');
  });

  it('refuses an unset variable without default, naming the variable and the key path', () => {
    const err = refusal(
      stack({ top: 'checkpoint:\n  enabled: true\n  control_auth_token: ${CKPT_GYM_TOKEN}' }),
    );
    expect(err.message).toBe(
      `${SOURCE}: checkpoint.control_auth_token: environment variable CKPT_GYM_TOKEN is not set ` +
        '(write ${CKPT_GYM_TOKEN:-default} to give a default)',
    );
  });

  it('refuses a malformed reference', () => {
    const err = refusal(stack({ top: 'token_capture: { dir: "${not a name}" }' }));
    expect(err.message).toContain('token_capture.dir: malformed reference "${not a name}"');
  });

  it('refuses a reference nested in a default', () => {
    const err = refusal(stack({ top: 'token_capture: { dir: "${A:-${B}}" }' }), { B: 'b' });
    expect(err.message).toContain('token_capture.dir: malformed reference "${A:-${B}"');
  });

  it('keeps $${ as a literal ${', () => {
    const settings = parse(
      stack({ top: 'checkpoint: { enabled: true, control_auth_token: "a$${B}" }' }),
    );
    expect(settings.checkpoint?.controlAuthToken).toBe('a${B}');
  });

  it('types an unquoted substituted number, and keeps a quoted one a string', () => {
    // Block style: in a flow mapping `{…}` an unquoted `${` is a YAML syntax error.
    const settings = parse(
      'servers:\n' +
        '  policy:\n' +
        '    kind: model\n' +
        '    app: "${APP}"\n' +
        '    port: ${PORT:-8101}\n' +
        '    checkpoint_policy: ${CP}\n',
      { APP: '7', CP: 'true' },
    );
    const policy = serverSettings(settings, 'policy');
    expect(policy.port).toBe(8101);
    expect(policy.app).toBe('7');
    expect(policy.config.checkpoint_policy).toBe(true);
  });

  it('substitutes before aliases resolve, so an alias sees the value', () => {
    const settings = parse(
      'x-common: &common { host: "${BIND}" }\n' +
        'servers:\n' +
        '  a: { <<: *common, kind: inference, app: fake, port: 8100 }\n',
      { BIND: '127.0.0.2' },
    );
    expect(serverSettings(settings, 'a').host).toBe('127.0.0.2');
  });
});

describe('checkpoint block', () => {
  it('refuses an unknown key even when checkpointing is disabled, naming the key', () => {
    const err = refusal(stack({ top: 'checkpoint: { enabled: false, lease_grace: 10 }' }));
    expect(err.message).toBe(
      `${SOURCE}: checkpoint.lease_grace: unknown key (allowed: enabled, control_auth_token, lease_grace_seconds, signing_key, file_mode, dir_mode)`,
    );
  });

  it.each([0, -1])('refuses lease_grace_seconds %s even when disabled', (grace) => {
    const err = refusal(stack({ top: `checkpoint: { lease_grace_seconds: ${grace} }` }));
    expect(err.message).toBe(`${SOURCE}: checkpoint.lease_grace_seconds: must be > 0`);
  });

  it('refuses an infinite lease grace', () => {
    const err = refusal(stack({ top: 'checkpoint: { lease_grace_seconds: .inf }' }));
    expect(err.message).toContain('checkpoint.lease_grace_seconds: must be number');
  });

  it.each([
    ['missing', 'checkpoint: { enabled: true }'],
    ['empty', 'checkpoint: { enabled: true, control_auth_token: "" }'],
    ['null', 'checkpoint: { enabled: true, control_auth_token: }'],
  ])('requires a control token when enabled (%s)', (_case, top) => {
    const err = refusal(stack({ top }));
    expect(err.message).toBe(
      `${SOURCE}: checkpoint.control_auth_token is required when checkpoint.enabled is true`,
    );
  });

  it('exposes CheckpointSettings only when enabled, and the validated block always', () => {
    const off = parse(stack({ top: 'checkpoint: { enabled: false, lease_grace_seconds: 5 }' }));
    expect(off.checkpoint).toBeUndefined();
    expect(off.checkpointBlock).toEqual({
      enabled: false,
      control_auth_token: null,
      lease_grace_seconds: 5,
    });
    const on = parse(
      stack({
        top: 'checkpoint: { enabled: true, control_auth_token: t, lease_grace_seconds: 1.5 }',
      }),
    );
    expect(on.checkpoint).toEqual({ enabled: true, controlAuthToken: 't', leaseGraceSeconds: 1.5 });
  });
});

describe('checkpoint file and directory modes', () => {
  it('passes octal mode strings to CheckpointSettings as numbers', () => {
    const on = parse(
      stack({
        top: 'checkpoint: { enabled: true, control_auth_token: t, file_mode: "0640", dir_mode: "750" }',
      }),
    );
    expect(on.checkpoint).toMatchObject({ fileMode: 0o640, dirMode: 0o750 });
    expect(on.checkpointBlock).toMatchObject({ file_mode: '0640', dir_mode: '750' });
  });

  it('leaves them unset when the file does, so the store keeps 0600 and 0700', () => {
    const on = parse(stack({ top: 'checkpoint: { enabled: true, control_auth_token: t }' }));
    expect(on.checkpoint).not.toHaveProperty('fileMode');
    expect(on.checkpoint).not.toHaveProperty('dirMode');
  });

  it.each([
    [
      'file_mode',
      '"0400"',
      'must be an octal mode string including 0600 (like "0600"), got "0400"',
    ],
    [
      'file_mode',
      '"0648"',
      'must be an octal mode string including 0600 (like "0600"), got "0648"',
    ],
    [
      'file_mode',
      '"rw-------"',
      'must be an octal mode string including 0600 (like "0600"), got "rw-------"',
    ],
    ['dir_mode', '"0600"', 'must be an octal mode string including 0700 (like "0700"), got "0600"'],
    [
      'dir_mode',
      '"01777"',
      'must be an octal mode string including 0700 (like "0700"), got "01777"',
    ],
  ])('refuses %s %s even when disabled', (key, value, message) => {
    const err = refusal(stack({ top: `checkpoint: { ${key}: ${value} }` }));
    expect(err.message).toBe(`${SOURCE}: checkpoint.${key}: ${message}`);
  });

  it('refuses an unquoted YAML number, which would not be read as octal', () => {
    const err = refusal(stack({ top: 'checkpoint: { file_mode: 0600 }' }));
    expect(err.message).toContain('checkpoint.file_mode: must be string');
  });
});

describe('defaults', () => {
  it('fills every block the file leaves out', () => {
    const settings = parse(stack());
    expect(settings.checkpoint).toBeUndefined();
    expect(settings.checkpointBlock).toEqual({
      enabled: false,
      control_auth_token: null,
      lease_grace_seconds: 600,
    });
    expect(settings.tokenCapture).toEqual({ enabled: false, dir: '/stacks/.ckpt-gym/capture' });
    expect(settings.http).toEqual({
      controlConnectionLimit: 256,
      controlConnectionLimitPerHost: 64,
      dataConnectionLimit: undefined,
      dataConnectionLimitPerHost: undefined,
    });
    const policy = serverSettings(settings, 'policy');
    expect(policy).toMatchObject({
      name: 'policy',
      kind: 'model',
      host: '127.0.0.1',
      numWorkers: 1,
    });
  });

  it('resolves a relative capture dir against the stack file, and keeps an absolute one', () => {
    const relative = parse(stack({ top: 'token_capture: { enabled: true, dir: ../capture }' }));
    expect(relative.tokenCapture).toEqual({ enabled: true, dir: '/capture' });
    const absolute = parse(stack({ top: 'token_capture: { dir: /var/capture }' }));
    expect(absolute.tokenCapture.dir).toBe('/var/capture');
  });

  it('resolves relative paths against the working directory when no source is given', () => {
    const settings = parseStackFile(stack(), { env: {} });
    expect(settings.tokenCapture.dir).toBe(resolve(process.cwd(), '.ckpt-gym/capture'));
    expect(settings.source).toBe('<stack file>');
  });
});

describe('connection pool limits', () => {
  it('defaults the control pool to 256 connections, 64 per host', () => {
    expect(controlPoolLimits(parse(stack()))).toEqual({ maxTotalSockets: 256, maxSockets: 64 });
  });

  it('reads configured limits, with 0 meaning unlimited', () => {
    const settings = parse(
      stack({
        top: 'http: { control_connection_limit: 0, control_connection_limit_per_host: 8, data_connection_limit: 100 }',
      }),
    );
    expect(controlPoolLimits(settings)).toEqual({ maxTotalSockets: Infinity, maxSockets: 8 });
    expect(dataPoolLimits(settings)).toEqual({ maxTotalSockets: 100, maxSockets: Infinity });
  });

  it('leaves the data pool unlimited when unset', () => {
    expect(dataPoolLimits(parse(stack()))).toEqual({
      maxTotalSockets: Infinity,
      maxSockets: Infinity,
    });
  });

  it.each([
    'control_connection_limit',
    'control_connection_limit_per_host',
    'data_connection_limit',
  ])('refuses a negative %s', (key) => {
    const err = refusal(stack({ top: `http: { ${key}: -1 }` }));
    expect(err.message).toBe(`${SOURCE}: http.${key}: must be >= 0`);
  });

  it('refuses a fractional limit and an unknown http key', () => {
    expect(refusal(stack({ top: 'http: { control_connection_limit: 1.5 }' })).message).toContain(
      'http.control_connection_limit: must be integer',
    );
    expect(refusal(stack({ top: 'http: { pool: 3 }' })).message).toContain(
      'http.pool: unknown key',
    );
  });
});

describe('servers', () => {
  it('refuses an unknown kind, listing the kinds', () => {
    const err = refusal(stack({ servers: ['x: { kind: database, app: pg, port: 5432 }'] }));
    expect(err.message).toBe(
      `${SOURCE}: servers.x.kind: must be one of inference, model, resources, agent, environment`,
    );
  });

  it('requires kind, app and port', () => {
    const err = refusal(stack({ servers: ['x: { host: 127.0.0.1 }'] }));
    expect(err.message.split('\n')).toEqual([
      `${SOURCE}: servers.x.kind: is required`,
      `${SOURCE}: servers.x.app: is required`,
      `${SOURCE}: servers.x.port: is required`,
    ]);
  });

  it('refuses a port outside 0..65535 and num_workers below 1', () => {
    const err = refusal(
      stack({ servers: ['x: { kind: inference, app: fake, port: 70000, num_workers: 0 }'] }),
    );
    expect(err.message).toContain('servers.x.port: must be <= 65535');
    expect(err.message).toContain('servers.x.num_workers: must be >= 1');
  });

  it('refuses a server name that cannot be a checkpoint instance', () => {
    const err = refusal(
      stack({ servers: ['"bad/name": { kind: inference, app: fake, port: 8100 }'] }),
    );
    expect(err.message).toBe(
      `${SOURCE}: servers.bad/name: server name must match ^[A-Za-z0-9][A-Za-z0-9._-]*$`,
    );
  });

  it('refuses a server named twice', () => {
    const err = refusal(
      stack({
        servers: [
          'a: { kind: inference, app: fake, port: 8100 }',
          'a: { kind: inference, app: fake, port: 8101 }',
        ],
      }),
    );
    expect(err.message).toMatch(/line 4, column 3: YAML syntax error: Map keys must be unique/);
  });

  it('refuses a file without servers and an unknown top-level key, but ignores x- keys', () => {
    expect(refusal('checkpoint: { enabled: false }\n').message).toBe(
      `${SOURCE}: servers: is required`,
    );
    expect(refusal(stack({ top: 'checkpiont: { enabled: true }' })).message).toContain(
      `${SOURCE}: checkpiont: unknown key (allowed: checkpoint, token_capture, http, telemetry, servers)`,
    );
    expect(() => parse(stack({ top: 'x-defaults: { anything: 1 }' }))).not.toThrow();
  });

  it('refuses a file that is not a mapping', () => {
    expect(refusal('- a\n- b\n').message).toBe(
      `${SOURCE}: (top level): the stack file must be a YAML mapping`,
    );
  });

  it('keeps kind-specific keys open for the app to validate', () => {
    const settings = parse(
      stack({
        servers: [
          'weather: { kind: resources, app: weather, port: 8102, checkpoint_verify: replay }',
        ],
      }),
    );
    expect(serverSettings(settings, 'weather').config.checkpoint_verify).toBe('replay');
  });
});

describe('server references', () => {
  const weather = 'weather: { kind: resources, app: weather, port: 8102 }';
  const agent =
    'agent: { kind: agent, app: simple, port: 8103, model_server: policy, resources_server: weather }';

  it('accepts references to servers of the right kind', () => {
    const settings = parse(
      stack({
        servers: [
          MODEL,
          weather,
          agent,
          'env: { kind: environment, app: single_agent_turn, port: 8104, agent_server: agent }',
        ],
      }),
    );
    expect(serversByKind(settings, 'environment').map((s) => s.name)).toEqual(['env']);
  });

  it('refuses a reference to a server that does not exist', () => {
    const err = refusal(
      stack({
        servers: [weather, 'agent: { kind: agent, app: simple, port: 8103, model_server: polcy }'],
      }),
    );
    expect(err.message).toBe(
      `${SOURCE}: servers.agent.model_server: names no server 'polcy' (servers: weather, agent)`,
    );
  });

  it.each([
    ['model_server', 'weather', 'a resources', 'a model'],
    ['resources_server', 'policy', 'a model', 'a resources'],
    ['agent_server', 'weather', 'a resources', 'an agent'],
  ])('refuses %s naming a server of another kind', (key, target, actual, expected) => {
    const err = refusal(
      stack({
        servers: [
          MODEL,
          weather,
          `x: { kind: environment, app: e, port: 8110, ${key}: ${target} }`,
        ],
      }),
    );
    expect(err.message).toBe(
      `${SOURCE}: servers.x.${key}: '${target}' is ${actual} server, not ${expected} server`,
    );
  });

  it('does not resolve a reference through the object prototype', () => {
    const err = refusal(
      stack({
        servers: ['agent: { kind: agent, app: simple, port: 8103, model_server: constructor }'],
      }),
    );
    expect(err.message).toContain("servers.agent.model_server: names no server 'constructor'");
  });

  it.each(['not a url', 'ftp://host/v1'])(
    'refuses a model backend_url that is not an http(s) URL: %s',
    (url) => {
      const err = refusal(
        stack({
          servers: [`policy: { kind: model, app: policy, port: 8101, backend_url: "${url}" }`],
        }),
      );
      expect(err.message).toBe(
        `${SOURCE}: servers.policy.backend_url: must be an http(s) URL, got "${url}"`,
      );
    },
  );

  it('refuses a backend_url that is not a string', () => {
    const err = refusal(
      stack({ servers: ['policy: { kind: model, app: policy, port: 8101, backend_url: 8100 }'] }),
    );
    expect(err.message).toBe(`${SOURCE}: servers.policy.backend_url: must be string`);
  });
});

describe('ports', () => {
  it('refuses two servers on the same port and host', () => {
    const err = refusal(
      stack({ servers: [MODEL, 'other: { kind: inference, app: fake, port: 8101 }'] }),
    );
    expect(err.message).toBe(
      `${SOURCE}: servers.other.port: port 8101 on 127.0.0.1 is already used by server 'policy'`,
    );
  });

  it('allows the same port on different hosts', () => {
    expect(() =>
      parse(
        stack({
          servers: [MODEL, 'other: { kind: inference, app: fake, host: 127.0.0.2, port: 8101 }'],
        }),
      ),
    ).not.toThrow();
  });

  it('treats a wildcard bind as colliding with every host', () => {
    const err = refusal(
      stack({
        servers: [MODEL, 'other: { kind: inference, app: fake, host: 0.0.0.0, port: 8101 }'],
      }),
    );
    expect(err.message).toContain(
      "servers.other.port: port 8101 on 0.0.0.0 is already used by server 'policy'",
    );
  });

  it('allows port 0 (pick a free port) more than once', () => {
    const settings = parse(
      stack({
        servers: [
          'a: { kind: inference, app: fake, port: 0 }',
          'b: { kind: inference, app: fake, port: 0 }',
        ],
      }),
    );
    expect([...settings.servers.keys()]).toEqual(['a', 'b']);
  });
});

describe('checkpointing limits', () => {
  const workers = 'policy: { kind: model, app: policy, port: 8101, num_workers: 2 }';
  const mcp = 'weather: { kind: resources, app: weather, port: 8102, expose_tools_over_mcp: true }';

  it('allows a model server several workers with checkpointing on', () => {
    const settings = parse(stack({ top: CHECKPOINT_ON, servers: [workers] }));
    expect(serverSettings(settings, 'policy').numWorkers).toBe(2);
  });

  it('allows a resources server several workers with checkpointing on', () => {
    const weather = 'weather: { kind: resources, app: weather, port: 8102, num_workers: 2 }';
    const settings = parse(stack({ top: CHECKPOINT_ON, servers: [MODEL, weather] }));
    expect(serverSettings(settings, 'weather').numWorkers).toBe(2);
  });

  it('allows an agent server several workers with checkpointing on (they are coordinated)', () => {
    const servers = [
      MODEL,
      'agent: { kind: agent, app: simple, port: 8103, model_server: policy, num_workers: 3 }',
    ];
    const settings = parse(stack({ top: CHECKPOINT_ON, servers }));
    expect(serverSettings(settings, 'agent').numWorkers).toBe(3);
  });

  it('allows an environment server several workers with checkpointing on (they are coordinated)', () => {
    const servers = [
      MODEL,
      'agent: { kind: agent, app: simple, port: 8103, model_server: policy }',
      'env: { kind: environment, app: counter, port: 8104, agent_server: agent, num_workers: 4 }',
    ];
    const settings = parse(stack({ top: CHECKPOINT_ON, servers }));
    expect(serverSettings(settings, 'env').numWorkers).toBe(4);
  });

  it('allows num_workers > 1 with checkpointing off', () => {
    expect(serverSettings(parse(stack({ servers: [workers] })), 'policy').numWorkers).toBe(2);
    const agent = 'agent: { kind: agent, app: simple, port: 8103, num_workers: 2 }';
    expect(serverSettings(parse(stack({ servers: [agent] })), 'agent').numWorkers).toBe(2);
  });

  it('allows MCP tool exposure with checkpointing on and off', () => {
    for (const top of [CHECKPOINT_ON, '']) {
      expect(
        serverSettings(parse(stack({ top, servers: [mcp] })), 'weather').config
          .expose_tools_over_mcp,
      ).toBe(true);
    }
  });

  it('refuses an agent capturing tokens through a model server outside the checkpoint gate', () => {
    const agent = 'agent: { kind: agent, app: simple, port: 8103, model_server: policy }';
    const top = `${CHECKPOINT_ON}\ntoken_capture: { enabled: true }`;
    const err = refusal(stack({ top, servers: [MODEL, agent] }));
    expect(err.message).toContain(
      "servers.agent.model_server: 'policy' must set checkpoint_policy: true",
    );
    const gated = 'policy: { kind: model, app: policy, port: 8101, checkpoint_policy: true }';
    expect(() => parse(stack({ top, servers: [gated, agent] }))).not.toThrow();
    expect(() => parse(stack({ top: CHECKPOINT_ON, servers: [MODEL, agent] }))).not.toThrow();
  });

  it('reports every problem of a file at once', () => {
    const agent = 'agent: { kind: agent, app: simple, port: 8104, model_server: nowhere }';
    const second = 'agent2: { kind: agent, app: simple, port: 8104, num_workers: 2 }';
    const err = refusal(stack({ top: CHECKPOINT_ON, servers: [workers, agent, second, mcp] }));
    expect(err.message.split('\n')).toHaveLength(2);
  });
});

describe('YAML syntax errors', () => {
  it('name the line, reporting only the first error', () => {
    const err = refusal('checkpoint:\n  enabled: true\nservers: [a,\n  b: c: d\n');
    expect(err.message).toMatch(
      new RegExp(`^${SOURCE}: line 4, column \\d+: YAML syntax error: [^\n]+$`),
    );
  });
});

describe('helpers', () => {
  const settings = parse(
    stack({
      servers: [
        MODEL,
        'inference: { kind: inference, app: fake, host: 0.0.0.0, port: 8100 }',
        'v6: { kind: inference, app: fake, host: "::1", port: 8109 }',
        'free: { kind: inference, app: fake, port: 0 }',
      ],
    }),
  );

  it('serverUrl builds http://host:port, reaching wildcard binds on loopback', () => {
    expect(serverUrl(settings, 'policy')).toBe('http://127.0.0.1:8101');
    expect(serverUrl(settings, 'inference')).toBe('http://127.0.0.1:8100');
    expect(serverUrl(settings, 'v6')).toBe('http://[::1]:8109');
  });

  it('serverUrl refuses a server whose port is picked at startup', () => {
    expect(() => serverUrl(settings, 'free')).toThrow(
      /servers\.free\.port: port 0 is picked at startup/,
    );
  });

  it('serverSettings refuses an unknown name, listing the servers', () => {
    expect(() => serverSettings(settings, 'nope')).toThrow(
      new ConfigError(`${SOURCE}: no server named 'nope' (servers: policy, inference, v6, free)`),
    );
  });

  it('serversByKind lists one kind in file order', () => {
    expect(serversByKind(settings, 'inference').map((s) => s.name)).toEqual([
      'inference',
      'v6',
      'free',
    ]);
    expect(serversByKind(settings, 'agent')).toEqual([]);
  });
});

describe('loadStackFile', () => {
  it('parses the example stack', () => {
    const settings = loadStackFile(EXAMPLE, {});
    expect(settings.checkpoint).toEqual({
      enabled: true,
      controlAuthToken: 'local-dev-token',
      leaseGraceSeconds: 600,
    });
    expect(settings.tokenCapture).toEqual({
      enabled: true,
      dir: join(dirname(EXAMPLE), '.ckpt-gym/capture'),
    });
    expect([...settings.servers.keys()]).toEqual([
      'inference',
      'policy',
      'weather',
      'counter',
      'simple_agent',
      'env',
    ]);
    expect(serverUrl(settings, 'env')).toBe('http://127.0.0.1:8104');
    expect(serverSettings(settings, 'policy').config).toMatchObject({
      backend_url: 'http://127.0.0.1:8100/v1',
      checkpoint_policy: true,
      checkpoint_generation_cuts: true,
    });
    expect(loadStackFile(EXAMPLE, { CKPT_GYM_TOKEN: 'prod' }).checkpoint?.controlAuthToken).toBe(
      'prod',
    );
  });

  it('names the file in errors and resolves paths against its directory', () => {
    const dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-settings-'));
    try {
      const file = join(dir, 'stack.yaml');
      writeFileSync(file, stack({ top: 'checkpoint: { lease_grace_seconds: 0 }' }));
      expect(() => loadStackFile(file, {})).toThrow(
        `${file}: checkpoint.lease_grace_seconds: must be > 0`,
      );
      writeFileSync(file, stack({ top: 'token_capture: { dir: cap }' }));
      expect(loadStackFile(file, {}).tokenCapture.dir).toBe(join(dir, 'cap'));
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('refuses a file it cannot read, naming it', () => {
    const missing = join(tmpdir(), 'ckpt-gym-no-such-stack.yaml');
    expect(() => loadStackFile(missing, {})).toThrow(`${missing}: cannot read the stack file`);
  });
});

describe("each kind's app keys (ParseOptions.kinds)", () => {
  const kinds: KindConfigSchemas = {
    model: {
      apps: {
        policy: {
          type: 'object',
          required: ['backend_url'],
          properties: {
            backend_url: { type: 'string' },
            checkpoint_generation_cuts: { type: 'boolean' },
            max_tokens: { type: 'integer' },
          },
        },
      },
    },
    inference: { apps: { fake: { type: 'object', properties: {} } } },
  };
  const withKinds = (servers: string[]) => () =>
    parseStackFile(stack({ servers }), { env: {}, source: SOURCE, kinds });

  it('refuses a mistyped key when the file is loaded, with the key it resembles', () => {
    const typo = `${MODEL.slice(0, -2)}, checkpoint_generation_cutz: true }`;
    expect(withKinds([typo])).toThrow(
      `${SOURCE}: servers.policy.checkpoint_generation_cutz: unknown key (allowed: kind, app, host, port, num_workers, backend_url, checkpoint_generation_cuts, max_tokens) (did you mean 'checkpoint_generation_cuts'?)`,
    );
    // Without the kinds' schemas only the keys core reads are checked.
    expect(() => parse(stack({ servers: [typo] }))).not.toThrow();
  });

  it('refuses a wrong type and a missing key, each as servers.<name>.<key>', () => {
    const message = (servers: string[]) => {
      try {
        withKinds(servers)();
      } catch (err) {
        return (err as Error).message.split('\n');
      }
      throw new Error('accepted');
    };
    expect(
      message([
        `${MODEL.slice(0, -2)}, max_tokens: many }`,
        'bare: { kind: model, app: policy, port: 8102 }',
      ]),
    ).toEqual([
      `${SOURCE}: servers.policy.max_tokens: must be integer`,
      `${SOURCE}: servers.bare.backend_url: is required`,
    ]);
  });

  it('leaves the keys of an app its kind does not list, and of a kind without a schema, unchecked', () => {
    // An external inference backend, a test's participants: not this CLI's to run.
    expect(withKinds(['vllm: { kind: inference, app: vllm, port: 8000, gpu: 0 }'])).not.toThrow();
    expect(withKinds(['p: { kind: model, app: test, port: 8102, anything: 1 }'])).not.toThrow();
    expect(
      withKinds(['w: { kind: resources, app: weather, port: 8102, anything: 1 }']),
    ).not.toThrow();
  });
});

describe('schemas', () => {
  it('are compiled at module load, not per parse', () => {
    const compile = jest.spyOn(Ajv.prototype, 'compile');
    try {
      parse(stack());
      refusal(stack({ top: 'http: { control_connection_limit: -1 }' }));
      expect(compile).not.toHaveBeenCalled();
    } finally {
      compile.mockRestore();
    }
  });
});
