/**
 * The stack file: one YAML file that names every server of a stack (so they find each other by
 * name) and holds the global `checkpoint:` block. This module only parses and validates, so a bad
 * file fails before any server listens. docs/stack-file.md is the schema a user reads.
 */
import { readFileSync } from 'node:fs';
import { dirname, resolve } from 'node:path';

import { Ajv, type ErrorObject } from 'ajv';
import { isAlias, isMap, isScalar, isSeq, parseDocument, type Node as YamlNode } from 'yaml';

import { ConfigError } from './errors.js';
import { MIN_SIGNING_KEY_BYTES, signingKeyBytes } from './signing.js';
import { closest, didYouMean } from './suggest.js';

export const SERVER_KINDS = ['inference', 'model', 'resources', 'agent', 'environment'] as const;
export type ServerKind = (typeof SERVER_KINDS)[number];

/** A server name is also the checkpoint `instance`, a directory name under `gym/<kind>/`. */
export const SERVER_NAME_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._-]*$/;

export const DEFAULT_LEASE_GRACE_SECONDS = 600;
export const DEFAULT_TOKEN_CAPTURE_DIR = './.ckpt-gym/capture';
export const DEFAULT_CONTROL_CONNECTION_LIMIT = 256;
export const DEFAULT_CONTROL_CONNECTION_LIMIT_PER_HOST = 64;
export const DEFAULT_SERVER_HOST = '127.0.0.1';

/** The resources-server key that would expose its tools over MCP (the seed's name for it). */
export const MCP_EXPOSURE_KEY = 'expose_tools_over_mcp';

/** Keys that name another server, and the kind that server must be. */
const SERVER_REFERENCES = {
  model_server: 'model',
  resources_server: 'resources',
  agent_server: 'agent',
} as const satisfies Record<string, ServerKind>;

/** The `checkpoint:` block as written, with defaults applied (snake_case, as in the file). */
export interface CheckpointBlock {
  readonly enabled: boolean;
  readonly control_auth_token: string | null;
  readonly lease_grace_seconds: number;
  /** The secret that signs manifests; absent when the file does not set it. */
  readonly signing_key?: string;
  /** Octal strings, as written (`"0600"`); absent: the store's defaults. */
  readonly file_mode?: string;
  readonly dir_mode?: string;
}

/** What a server needs when checkpointing is on; absent (undefined) when it is off. */
export interface CheckpointSettings {
  readonly enabled: true;
  readonly controlAuthToken: string;
  readonly leaseGraceSeconds: number;
  /** `checkpoint.signing_key` as bytes; absent when not set, and then manifests are not signed. */
  readonly signingKey?: Buffer;
  /** Mode of the records files and manifests a commit writes; absent: the store's 0o600. */
  readonly fileMode?: number;
  /** Mode of the checkpoint directories a commit creates; absent: the store's 0o700. */
  readonly dirMode?: number;
}

export interface TokenCaptureSettings {
  readonly enabled: boolean;
  /** Absolute; a relative `dir` in the file is resolved against the stack file's directory. */
  readonly dir: string;
}

/** Connection pool limits; 0 means unlimited. Data limits are undefined when not set. */
export interface HttpSettings {
  readonly controlConnectionLimit: number;
  readonly controlConnectionLimitPerHost: number;
  readonly dataConnectionLimit: number | undefined;
  readonly dataConnectionLimitPerHost: number | undefined;
}

/** The `telemetry:` block: where this stack's spans go (the `OTEL_*` variables override it). */
export interface TelemetrySettings {
  /** `service.name` of every process of the stack; absent: each server's own name. */
  readonly serviceName?: string;
  /** The OTLP/HTTP traces URL (as `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); absent: tracing off. */
  readonly tracesEndpoint?: string;
  /** The share of rollouts whose requests are traced, 0 to 1; absent: every one. */
  readonly rolloutSampleRatio?: number;
}

export interface ServerSettings {
  /** The key in `servers:`; also the server's checkpoint instance. */
  readonly name: string;
  readonly kind: ServerKind;
  readonly app: string;
  readonly host: string;
  /** 0 means "pick a free port at startup". */
  readonly port: number;
  readonly numWorkers: number;
  /** The whole validated mapping, snake_case, including the app's own keys for it to validate. */
  readonly config: Readonly<Record<string, unknown>>;
}

export interface StackSettings {
  /** The file name used in messages. */
  readonly source: string;
  /** Absolute directory that relative paths in the file resolve against. */
  readonly baseDir: string;
  readonly checkpoint: CheckpointSettings | undefined;
  readonly checkpointBlock: CheckpointBlock;
  readonly tokenCapture: TokenCaptureSettings;
  readonly http: HttpSettings;
  readonly telemetry: TelemetrySettings;
  /** In file order. */
  readonly servers: ReadonlyMap<string, ServerSettings>;
}

export type Env = Readonly<Record<string, string | undefined>>;

/** The JSON schema of one app's own keys: an object schema (the keys every server has are added). */
export interface AppConfigSchema {
  readonly type: 'object';
  readonly properties: Readonly<Record<string, object>>;
  readonly required?: readonly string[];
}

/**
 * A server kind's apps and their keys, as its package declares them (core imports no server). An
 * app not listed is not checked: a stack file may name servers this CLI does not run (an external
 * inference backend, a test's participants); serving one refuses it.
 */
export interface KindConfigSchema {
  readonly apps: Readonly<Record<string, AppConfigSchema>>;
}

/** The kinds whose servers' keys are checked at load; a kind not in it is not checked. */
export type KindConfigSchemas = Readonly<Partial<Record<ServerKind, KindConfigSchema>>>;

export interface ParseOptions {
  env?: Env;
  /** The file's path: named in messages and the base of relative paths (default: cwd). */
  source?: string;
  /** Each kind's app keys: a key its app does not know, or a mistyped value, refuses the file. */
  kinds?: KindConfigSchemas;
}

// ---------------------------------------------------------------------------------------------
// Schemas, compiled once at module load.

const connectionLimit = { type: 'integer', minimum: 0 } as const;

const CHECKPOINT_SCHEMA = {
  type: 'object',
  additionalProperties: false,
  properties: {
    enabled: { type: 'boolean', default: false },
    control_auth_token: { type: ['string', 'null'], default: null },
    lease_grace_seconds: {
      type: 'number',
      exclusiveMinimum: 0,
      default: DEFAULT_LEASE_GRACE_SECONDS,
    },
    // No default: a block without it reads exactly as before.
    signing_key: { type: 'string' },
    file_mode: { type: 'string' },
    dir_mode: { type: 'string' },
  },
} as const;

/** The keys every server has, whatever its kind. */
const COMMON_SERVER_KEYS = {
  kind: { type: 'string', enum: SERVER_KINDS },
  app: { type: 'string', minLength: 1 },
  host: { type: 'string', minLength: 1, default: DEFAULT_SERVER_HOST },
  port: { type: 'integer', minimum: 0, maximum: 65535 },
  num_workers: { type: 'integer', minimum: 1, default: 1 },
} as const;

const SERVER_SCHEMA = {
  type: 'object',
  required: ['kind', 'app', 'port'],
  // Open: each kind's schema (ParseOptions.kinds) checks its app's keys. Only the keys this
  // module reads are typed here.
  additionalProperties: true,
  properties: {
    ...COMMON_SERVER_KEYS,
    model_server: { type: 'string', minLength: 1 },
    resources_server: { type: 'string', minLength: 1 },
    agent_server: { type: 'string', minLength: 1 },
    backend_url: { type: 'string' },
    checkpoint_policy: { type: 'boolean' },
    checkpoint_generation_cuts: { type: 'boolean' },
    [MCP_EXPOSURE_KEY]: { type: 'boolean' },
  },
} as const;

const STACK_SCHEMA = {
  type: 'object',
  required: ['servers'],
  additionalProperties: false,
  // `x-` keys hold YAML anchors for reuse, as in docker compose files; they are ignored.
  patternProperties: { '^x-': true },
  properties: {
    checkpoint: { ...CHECKPOINT_SCHEMA, default: {} },
    token_capture: {
      type: 'object',
      additionalProperties: false,
      default: {},
      properties: {
        enabled: { type: 'boolean', default: false },
        dir: { type: 'string', minLength: 1, default: DEFAULT_TOKEN_CAPTURE_DIR },
      },
    },
    http: {
      type: 'object',
      additionalProperties: false,
      default: {},
      properties: {
        control_connection_limit: { ...connectionLimit, default: DEFAULT_CONTROL_CONNECTION_LIMIT },
        control_connection_limit_per_host: {
          ...connectionLimit,
          default: DEFAULT_CONTROL_CONNECTION_LIMIT_PER_HOST,
        },
        data_connection_limit: connectionLimit,
        data_connection_limit_per_host: connectionLimit,
      },
    },
    telemetry: {
      type: 'object',
      additionalProperties: false,
      default: {},
      properties: {
        service_name: { type: 'string', minLength: 1 },
        traces: {
          type: 'object',
          additionalProperties: false,
          properties: {
            endpoint: { type: 'string', pattern: '^https?://' },
            rollout_sample_ratio: { type: 'number', minimum: 0, maximum: 1 },
          },
        },
      },
    },
    servers: {
      type: 'object',
      minProperties: 1,
      propertyNames: { pattern: SERVER_NAME_PATTERN.source },
      additionalProperties: SERVER_SCHEMA,
    },
  },
} as const;

const ajv = new Ajv({
  allErrors: true,
  useDefaults: true,
  verbose: true,
  strict: true,
  allowUnionTypes: true,
});
const validateStack = ajv.compile(STACK_SCHEMA);

/** The validated file, as ajv leaves it after applying defaults. */
interface RawServer extends Record<string, unknown> {
  kind: ServerKind;
  app: string;
  host: string;
  port: number;
  num_workers: number;
  model_server?: string;
  resources_server?: string;
  agent_server?: string;
  backend_url?: string;
  checkpoint_policy?: boolean;
  expose_tools_over_mcp?: boolean;
}

interface RawStack {
  checkpoint: CheckpointBlock;
  token_capture: { enabled: boolean; dir: string };
  http: {
    control_connection_limit: number;
    control_connection_limit_per_host: number;
    data_connection_limit?: number;
    data_connection_limit_per_host?: number;
  };
  telemetry: {
    service_name?: string;
    traces?: { endpoint?: string; rollout_sample_ratio?: number };
  };
  servers: Record<string, RawServer>;
}

// ---------------------------------------------------------------------------------------------
// Entry points.

/** Reads, interpolates and validates a stack file; every problem is a `ConfigError`. */
export function loadStackFile(
  path: string,
  env: Env = process.env,
  kinds?: KindConfigSchemas,
): StackSettings {
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (err) {
    throw new ConfigError(`${path}: cannot read the stack file: ${(err as Error).message}`, {
      cause: err,
    });
  }
  return parseStackFile(text, { env, source: path, ...(kinds ? { kinds } : {}) });
}

/** Parses stack file text. `source` names the file in messages and anchors relative paths. */
export function parseStackFile(text: string, opts: ParseOptions = {}): StackSettings {
  const source = opts.source ?? '<stack file>';
  const baseDir = opts.source === undefined ? process.cwd() : dirname(resolve(opts.source));
  const fail = (problems: readonly string[]): never => {
    throw new ConfigError(problems.map((p) => `${source}: ${p}`).join('\n'));
  };

  const doc = parseDocument(text, { merge: true });
  // Later syntax errors are mostly echoes of the first one.
  const [syntaxError] = doc.errors;
  if (syntaxError) fail([yamlErrorProblem(syntaxError)]);

  const interpolationProblems: string[] = [];
  if (doc.contents) {
    interpolateNode(doc.contents, [], opts.env ?? process.env, interpolationProblems);
  }
  if (interpolationProblems.length > 0) fail(interpolationProblems);

  const data: unknown = doc.toJS();
  if (!validateStack(data)) fail(schemaProblems(validateStack.errors ?? [], data));
  const raw = data as RawStack;

  const appProblems = Object.entries(raw.servers).flatMap(([name, server]) =>
    appConfigProblems(name, server, opts.kinds?.[server.kind]),
  );
  if (appProblems.length > 0) fail(appProblems);
  const problems = stackProblems(raw);
  if (problems.length > 0) fail(problems);
  return buildSettings(raw, source, baseDir);
}

// ---------------------------------------------------------------------------------------------
// Helpers for consumers.

/** The named server, or a `ConfigError` listing the servers the file has. */
export function serverSettings(settings: StackSettings, name: string): ServerSettings {
  const server = settings.servers.get(name);
  if (!server) {
    const known = [...settings.servers.keys()].join(', ');
    throw new ConfigError(`${settings.source}: no server named '${name}' (servers: ${known})`);
  }
  return server;
}

/** The base URL other processes use to reach a server; wildcard binds are reached on loopback. */
export function serverUrl(settings: StackSettings, name: string): string {
  const server = serverSettings(settings, name);
  if (server.port === 0) {
    throw new ConfigError(
      `${settings.source}: servers.${name}.port: port 0 is picked at startup, so no other ` +
        'server can reach it by URL; give it a fixed port',
    );
  }
  const host = connectHost(server.host);
  return `http://${host.includes(':') ? `[${host}]` : host}:${server.port}`;
}

/** The servers of one kind, in file order. */
export function serversByKind(settings: StackSettings, kind: ServerKind): ServerSettings[] {
  return [...settings.servers.values()].filter((server) => server.kind === kind);
}

/** Pool limits in `http.Agent` terms (0 in the file → `Infinity`). */
export interface PoolLimits {
  readonly maxTotalSockets: number;
  readonly maxSockets: number;
}

/** The reserved control pool: not shared with data calls, so parked data calls cannot starve it. */
export function controlPoolLimits(settings: StackSettings): PoolLimits {
  return {
    maxTotalSockets: unlimitedIfZero(settings.http.controlConnectionLimit),
    maxSockets: unlimitedIfZero(settings.http.controlConnectionLimitPerHost),
  };
}

/** The data pool; unset limits are unlimited, like node's own agent. */
export function dataPoolLimits(settings: StackSettings): PoolLimits {
  return {
    maxTotalSockets: unlimitedIfZero(settings.http.dataConnectionLimit ?? 0),
    maxSockets: unlimitedIfZero(settings.http.dataConnectionLimitPerHost ?? 0),
  };
}

function unlimitedIfZero(limit: number): number {
  return limit === 0 ? Infinity : limit;
}

const WILDCARD_HOSTS = new Set(['0.0.0.0', '::']);

function connectHost(bindHost: string): string {
  if (bindHost === '0.0.0.0') return '127.0.0.1';
  if (bindHost === '::') return '::1';
  return bindHost;
}

// ---------------------------------------------------------------------------------------------
// Interpolation: `${VAR}`, `${VAR:-default}` (default when unset or empty), `$${` for a literal.

const REFERENCE = /\$\$\{|\$\{([^}]*)\}|\$\{/g;
const REFERENCE_BODY = /^([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?$/s;

type PathSegment = string | number;

function formatKeyPath(path: readonly PathSegment[]): string {
  let out = '';
  for (const segment of path) {
    out += typeof segment === 'number' ? `[${segment}]` : out === '' ? segment : `.${segment}`;
  }
  return out === '' ? '(top level)' : out;
}

/** Substitutes references in one string; problems name the variable. */
function interpolate(value: string, env: Env): { value: string; problems: string[] } {
  const problems: string[] = [];
  const out = value.replace(REFERENCE, (match, body: string | undefined) => {
    if (match === '$${') return '${';
    const parsed = body === undefined ? null : REFERENCE_BODY.exec(body);
    // A nested reference in a default would otherwise end at its own `}` and leave a stray one.
    if (!parsed || parsed[2]?.includes('${')) {
      problems.push(
        `malformed reference ${JSON.stringify(match)}: use \${NAME} or \${NAME:-default}`,
      );
      return match;
    }
    const [, name = '', fallback] = parsed;
    const set = env[name];
    if (fallback !== undefined) return set === undefined || set === '' ? fallback : set;
    if (set === undefined) {
      problems.push(
        `environment variable ${name} is not set (write \${${name}:-default} to give a default)`,
      );
      return match;
    }
    return set;
  });
  return { value: out, problems };
}

/**
 * Interpolates every string scalar under `node`, in place, before aliases are resolved (so an
 * alias sees the substituted value). Map keys are never interpolated. An unquoted scalar is typed
 * again after substitution, so `port: ${PORT:-8100}` is a number.
 */
function interpolateNode(
  node: YamlNode,
  path: readonly PathSegment[],
  env: Env,
  problems: string[],
): void {
  if (isMap(node)) {
    for (const pair of node.items) {
      const key = isScalar(pair.key) ? String(pair.key.value) : String(pair.key);
      if (pair.value && !isAlias(pair.value)) {
        interpolateNode(pair.value as YamlNode, [...path, key], env, problems);
      }
    }
  } else if (isSeq(node)) {
    node.items.forEach((item, index) => {
      if (item && !isAlias(item)) {
        interpolateNode(item as YamlNode, [...path, index], env, problems);
      }
    });
  } else if (isScalar(node) && typeof node.value === 'string' && node.value.includes('${')) {
    const result = interpolate(node.value, env);
    for (const problem of result.problems) problems.push(`${formatKeyPath(path)}: ${problem}`);
    node.value = node.type === 'PLAIN' ? retype(result.value) : result.value;
  }
}

/** Number and boolean results of an unquoted scalar become those types; anything else stays text. */
function retype(text: string): unknown {
  const doc = parseDocument(text);
  const contents = doc.contents;
  if (doc.errors.length > 0 || !isScalar(contents) || contents.comment) return text;
  const typed = contents.value;
  return typeof typed === 'number' || typeof typed === 'boolean' ? typed : text;
}

function yamlErrorProblem(error: {
  message: string;
  linePos?: [{ line: number; col: number }, ...unknown[]];
}): string {
  const reason = error.message.split('\n')[0]?.replace(/ at line \d+, column \d+:?$/, '') ?? '';
  const where = error.linePos
    ? `line ${error.linePos[0].line}, column ${error.linePos[0].col}: `
    : '';
  return `${where}YAML syntax error: ${reason}`;
}

// ---------------------------------------------------------------------------------------------
// Schema errors → "key.path: reason".

function schemaProblems(errors: readonly ErrorObject[], data: unknown): string[] {
  const problems: string[] = [];
  for (const error of errors) {
    const problem = schemaProblem(error, data);
    if (problem !== undefined && !problems.includes(problem)) problems.push(problem);
  }
  return problems;
}

function schemaProblem(error: ErrorObject, data: unknown): string | undefined {
  const path = pointerPath(error.instancePath, data);
  const at = (...extra: PathSegment[]) => formatKeyPath([...path, ...extra]);
  const params = error.params as Record<string, unknown>;
  switch (error.keyword) {
    case 'propertyNames':
      return undefined; // reported by the inner pattern error, which names the property
    case 'pattern':
      if (error.propertyName !== undefined) {
        return `${at(error.propertyName)}: server name must match ${SERVER_NAME_PATTERN.source}`;
      }
      break;
    case 'additionalProperties': {
      const key = String(params.additionalProperty);
      const allowed = Object.keys(
        (error.parentSchema as { properties?: object } | undefined)?.properties ?? {},
      );
      return `${at(key)}: unknown key (allowed: ${allowed.join(', ')})${didYouMean(closest(key, allowed))}`;
    }
    case 'required':
      return `${at(String(params.missingProperty))}: is required`;
    case 'enum':
      return `${at()}: must be one of ${(params.allowedValues as unknown[]).join(', ')}`;
    case 'type':
      if (path.length === 0) return '(top level): the stack file must be a YAML mapping';
      // ajv writes a union as `boolean,null`.
      return `${at()}: must be ${String(params.type).split(',').join(' or ')}`;
  }
  return `${at()}: ${error.message ?? 'is invalid'}`;
}

/** JSON pointer → key path, with array indices told apart by looking at the data. */
function pointerPath(pointer: string, data: unknown): PathSegment[] {
  const path: PathSegment[] = [];
  let current = data;
  for (const token of pointer.split('/').slice(1)) {
    const key = token.replace(/~1/g, '/').replace(/~0/g, '~');
    const segment = Array.isArray(current) ? Number(key) : key;
    path.push(segment);
    current = (current as Record<PathSegment, unknown> | undefined)?.[segment];
  }
  return path;
}

// ---------------------------------------------------------------------------------------------
// Each server's own keys, against its kind's schema for its app.

/** Compiled once per app schema: the kinds' tables are module constants of their packages. */
const appValidators = new WeakMap<AppConfigSchema, ReturnType<typeof ajv.compile>>();

function appValidator(schema: AppConfigSchema): ReturnType<typeof ajv.compile> {
  let validate = appValidators.get(schema);
  if (!validate) {
    validate = ajv.compile({
      type: 'object',
      additionalProperties: false,
      required: schema.required ?? [],
      properties: { ...COMMON_SERVER_KEYS, ...schema.properties },
    });
    appValidators.set(schema, validate);
  }
  return validate;
}

/** `servers.<name>.<key>: …` for each key the server's app does not know or takes another type. */
function appConfigProblems(
  name: string,
  server: RawServer,
  kind: KindConfigSchema | undefined,
): string[] {
  const schema = kind && Object.hasOwn(kind.apps, server.app) ? kind.apps[server.app] : undefined;
  if (!schema) return [];
  const validate = appValidator(schema);
  if (validate(server)) return [];
  const problems = schemaProblems(validate.errors ?? [], server);
  return problems.map((problem) => `servers.${name}.${problem}`);
}

// ---------------------------------------------------------------------------------------------
// Rules that span keys or servers, on a file the schema accepted.

function stackProblems(raw: RawStack): string[] {
  const servers = Object.entries(raw.servers);
  return [
    ...checkpointProblems(raw.checkpoint),
    ...servers.flatMap(([name, server]) => referenceProblems(name, server, raw.servers)),
    ...servers.flatMap(([name, server]) => backendUrlProblems(name, server)),
    ...portProblems(servers),
    ...(raw.checkpoint.enabled && raw.token_capture.enabled
      ? capturePolicyProblems(raw.servers)
      : []),
  ];
}

function checkpointProblems(block: CheckpointBlock): string[] {
  const problems = [
    modeProblem('file_mode', block.file_mode, 0o600),
    modeProblem('dir_mode', block.dir_mode, 0o700),
  ].filter((problem) => problem !== undefined);
  if (block.enabled && !block.control_auth_token) {
    problems.unshift('checkpoint.control_auth_token is required when checkpoint.enabled is true');
  }
  const keyBytes =
    block.signing_key === undefined ? undefined : signingKeyBytes(block.signing_key).length;
  if (keyBytes !== undefined && keyBytes < MIN_SIGNING_KEY_BYTES) {
    // The key itself is never echoed: it is a secret.
    problems.push(
      `checkpoint.signing_key: must be at least ${MIN_SIGNING_KEY_BYTES} bytes of UTF-8, got ${keyBytes}`,
    );
  }
  return problems;
}

/** An octal string such as `"0600"` or `"640"`: a YAML `0600` would be the integer 600. */
const OCTAL_MODE = /^0?[0-7]{3}$/;

/** Why `mode` cannot be the store's: not octal, or not granting the owner `owner` (0600, 0700). */
function modeProblem(key: string, mode: string | undefined, owner: number): string | undefined {
  if (mode === undefined) return undefined;
  if (OCTAL_MODE.test(mode) && (parseInt(mode, 8) & owner) === owner) return undefined;
  const example = `0${owner.toString(8)}`;
  return `checkpoint.${key}: must be an octal mode string including ${example} (like "${example}"), got ${JSON.stringify(mode)}`;
}

function referenceProblems(
  name: string,
  server: RawServer,
  all: Record<string, RawServer>,
): string[] {
  const problems: string[] = [];
  for (const [key, kind] of Object.entries(SERVER_REFERENCES)) {
    const target = server[key];
    if (typeof target !== 'string') continue;
    const targetServer = Object.hasOwn(all, target) ? all[target] : undefined;
    if (!targetServer) {
      problems.push(
        `servers.${name}.${key}: names no server '${target}' (servers: ${Object.keys(all).join(', ')})`,
      );
    } else if (targetServer.kind !== kind) {
      problems.push(
        `servers.${name}.${key}: '${target}' is ${aKind(targetServer.kind)} server, not ${aKind(kind)} server`,
      );
    }
  }
  return problems;
}

function aKind(kind: ServerKind): string {
  return /^[aeiou]/.test(kind) ? `an ${kind}` : `a ${kind}`;
}

function backendUrlProblems(name: string, server: RawServer): string[] {
  const url = server.backend_url;
  if (server.kind !== 'model' || url === undefined) return [];
  const parsed = URL.canParse(url) ? new URL(url) : undefined;
  if (parsed?.protocol === 'http:' || parsed?.protocol === 'https:') return [];
  return [`servers.${name}.backend_url: must be an http(s) URL, got ${JSON.stringify(url)}`];
}

/** Two servers collide on a fixed port when they bind the same host, or either binds every host. */
function portProblems(servers: ReadonlyArray<[string, RawServer]>): string[] {
  const problems: string[] = [];
  servers.forEach(([name, server], index) => {
    if (server.port === 0) return;
    const earlier = servers
      .slice(0, index)
      .find(
        ([, other]) =>
          other.port === server.port &&
          (other.host === server.host ||
            WILDCARD_HOSTS.has(other.host) ||
            WILDCARD_HOSTS.has(server.host)),
      );
    if (earlier) {
      problems.push(
        `servers.${name}.port: port ${server.port} on ${server.host} is already used by server '${earlier[0]}'`,
      );
    }
  });
  return problems;
}

/** SPEC §5: a model server an agent captures tokens through must be inside the checkpoint gate. */
function capturePolicyProblems(all: Record<string, RawServer>): string[] {
  const problems: string[] = [];
  for (const [name, server] of Object.entries(all)) {
    const target = server.kind === 'agent' ? server.model_server : undefined;
    const model = target !== undefined && Object.hasOwn(all, target) ? all[target] : undefined;
    // A missing or wrong-kind target is already reported by referenceProblems.
    if (model?.kind !== 'model' || model.checkpoint_policy === true) continue;
    problems.push(
      `servers.${name}.model_server: '${target}' must set checkpoint_policy: true when checkpoint ` +
        'and token_capture are enabled, or the tokens it captures escape the checkpoint',
    );
  }
  return problems;
}

function buildSettings(raw: RawStack, source: string, baseDir: string): StackSettings {
  const block = raw.checkpoint;
  const checkpoint: CheckpointSettings | undefined =
    block.enabled && block.control_auth_token
      ? {
          enabled: true,
          controlAuthToken: block.control_auth_token,
          leaseGraceSeconds: block.lease_grace_seconds,
          ...(block.signing_key === undefined
            ? {}
            : { signingKey: signingKeyBytes(block.signing_key) }),
          ...(block.file_mode === undefined ? {} : { fileMode: parseInt(block.file_mode, 8) }),
          ...(block.dir_mode === undefined ? {} : { dirMode: parseInt(block.dir_mode, 8) }),
        }
      : undefined;
  const servers = new Map<string, ServerSettings>();
  for (const [name, server] of Object.entries(raw.servers)) {
    servers.set(name, {
      name,
      kind: server.kind,
      app: server.app,
      host: server.host,
      port: server.port,
      numWorkers: server.num_workers,
      config: server,
    });
  }
  return {
    source,
    baseDir,
    checkpoint,
    checkpointBlock: block,
    tokenCapture: {
      enabled: raw.token_capture.enabled,
      dir: resolve(baseDir, raw.token_capture.dir),
    },
    http: {
      controlConnectionLimit: raw.http.control_connection_limit,
      controlConnectionLimitPerHost: raw.http.control_connection_limit_per_host,
      dataConnectionLimit: raw.http.data_connection_limit,
      dataConnectionLimitPerHost: raw.http.data_connection_limit_per_host,
    },
    telemetry: telemetrySettings(raw.telemetry),
    servers,
  };
}

function telemetrySettings(block: RawStack['telemetry']): TelemetrySettings {
  const endpoint = block.traces?.endpoint;
  const ratio = block.traces?.rollout_sample_ratio;
  return {
    ...(block.service_name === undefined ? {} : { serviceName: block.service_name }),
    ...(endpoint === undefined ? {} : { tracesEndpoint: endpoint }),
    ...(ratio === undefined ? {} : { rolloutSampleRatio: ratio }),
  };
}
