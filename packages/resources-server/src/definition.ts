/**
 * What a resources server is: a definition the framework turns into an HTTP server. A definition
 * names its checkpoint declarations (what its code can do across a crash), its tools, its seed,
 * verify and close behaviour, and — for `exported` servers — the session hooks. The startup checks
 * here are pure functions, run whether or not checkpointing is on.
 */
import {
  ConfigError,
  type EpisodeId,
  type JsonObject,
  type JsonValue,
} from '@ckpt-gym/core/protocol';

export const CHECKPOINT_MODES = ['restart_only', 'stateless', 'exported'] as const;
export type CheckpointMode = (typeof CHECKPOINT_MODES)[number];
export const VERIFY_MODES = ['wait', 'replay'] as const;
export type VerifyMode = (typeof VERIFY_MODES)[number];

export const SEED_ROUTE = '/seed_session';
export const CLOSE_ROUTE = '/close_session';
export const VERIFY_ROUTE = '/verify';
export const AGGREGATE_ROUTE = '/aggregate_metrics';
export const DEFAULT_SESSION_STARTS: readonly string[] = [SEED_ROUTE];
/** Names a tool may not take: they are the framework's own routes. */
export const RESERVED_TOOL_NAMES: readonly string[] = [
  'verify',
  'seed_session',
  'close_session',
  'aggregate_metrics',
  'mcp',
];

/** Async, and each works on every session at once (a sandbox per session snapshots concurrently). */
export interface SessionHooks {
  /** A snapshot per session id it still holds; ids it no longer holds are left out. */
  exportSessionStates(sessionIds: readonly string[]): Promise<Record<string, JsonValue>>;
  /**
   * Validates every state, then installs all of them, or throws having installed none. A large
   * state read back from a checkpoint is handed over on its own, when a request first uses its
   * session (a restore then spares decoding states nothing uses).
   */
  restoreSessionStates(states: Readonly<Record<string, JsonValue>>): Promise<void>;
  /** Frees a discarded session; runs again after a retire that was cut short, so it must be idempotent. */
  retireSessionState(sessionId: string): Promise<void>;
}

export const SESSION_HOOK_NAMES = [
  'exportSessionStates',
  'restoreSessionStates',
  'retireSessionState',
] as const satisfies readonly (keyof SessionHooks)[];

/** What the framework hands every handler. */
export interface HandlerContext {
  /** The session the request is on (the cookie's, or the one a seed starts). */
  readonly sessionId: string;
  /** The episode the `/ng-rollout/<capture key>` prefix named, if any. */
  readonly episode: EpisodeId | undefined;
  readonly body: JsonObject;
  /** Aborted when the client goes away. */
  readonly signal: AbortSignal;
  /** For protocols whose session ends on some other route (a terminal step): ends it on success. */
  endSession(): void;
}

/** A native (environment-server) seed, as validated by the framework. */
export interface NativeSeed {
  readonly resourcesSessionId: string;
  readonly episode: EpisodeId;
  readonly taskId: { readonly taskset: string; readonly task_id: string };
  readonly taskData: JsonObject;
}

export interface SeedContext extends HandlerContext {
  /** Present for a native body; a legacy body is free-form and read from `body`. */
  readonly native: NativeSeed | undefined;
}

export interface SeedResult {
  /** The session the seed started, when the handler replaces the framework's id. */
  sessionId?: string;
  /** A legacy seed's reply (a native seed's reply shape is fixed). */
  reply?: JsonObject;
}

export interface VerifyContext extends HandlerContext {
  /** The agent's final Responses API output (or plain text), from the body's `response`. */
  readonly response: JsonValue | undefined;
  /** The task's data: the body's `verification_input`, else the body without `response`. */
  readonly taskData: JsonObject;
  /** The task data of the native seed that started this session, if any. */
  readonly seededTaskData: JsonObject | undefined;
}

export interface VerifyResult {
  reward: number;
  /** Extra reply keys (they may not replace `reward`). */
  extra?: JsonObject;
}

export type ToolHandler = (ctx: HandlerContext) => Promise<JsonValue> | JsonValue;

export interface ResourcesServerDefinition {
  /** The app's name (for messages). */
  readonly app: string;
  /** Default `restart_only`. Typed loosely on purpose: a typo is caught at startup, by name. */
  readonly checkpointMode?: string;
  /** Default `wait`. */
  readonly checkpointVerify?: string;
  /** Routes that start a session; default `["/seed_session"]`. Others must be tools. */
  readonly sessionStarts?: readonly string[];
  /** `POST /<name>` for each tool. */
  readonly tools: Readonly<Record<string, ToolHandler>>;
  seedSession?(ctx: SeedContext): Promise<SeedResult | void> | SeedResult | void;
  verify(ctx: VerifyContext): Promise<VerifyResult> | VerifyResult;
  /** Frees the session's state; must tolerate an unknown or already closed session. */
  closeSession?(sessionId: string): Promise<void> | void;
  aggregateMetrics?(verifyResponses: readonly JsonObject[]): JsonObject;
  readonly hooks?: Partial<SessionHooks>;
}

/** The checked declarations a server runs with. */
export interface Declarations {
  readonly mode: CheckpointMode;
  readonly verify: VerifyMode;
  readonly sessionStarts: readonly string[];
  readonly hooks: SessionHooks;
}

function oneOf<T extends string>(
  attribute: string,
  value: string | undefined,
  allowed: readonly T[],
  fallback: T,
  app: string,
): T {
  if (value === undefined) return fallback;
  if ((allowed as readonly string[]).includes(value)) return value as T;
  throw new ConfigError(
    `resources server '${app}': ${attribute} ${JSON.stringify(value)} is not one of ${allowed.map((a) => JSON.stringify(a)).join(', ')}`,
  );
}

export function checkpointModeOf(def: ResourcesServerDefinition): CheckpointMode {
  return oneOf('checkpoint_mode', def.checkpointMode, CHECKPOINT_MODES, 'restart_only', def.app);
}

export function verifyModeOf(def: ResourcesServerDefinition): VerifyMode {
  return oneOf('checkpoint_verify', def.checkpointVerify, VERIFY_MODES, 'wait', def.app);
}

/** The hook names an `exported` server leaves out. */
export function missingHooks(def: ResourcesServerDefinition): string[] {
  return SESSION_HOOK_NAMES.filter((name) => typeof def.hooks?.[name] !== 'function');
}

function toolRoute(name: string): string {
  return `/${name}`;
}

/** Problems with tool names and declared session starts. */
export function routeProblems(def: ResourcesServerDefinition): string[] {
  const problems: string[] = [];
  for (const name of Object.keys(def.tools)) {
    if (RESERVED_TOOL_NAMES.includes(name)) problems.push(`tool '${name}' uses a reserved name`);
    else if (!/^[A-Za-z0-9_.-]+$/.test(name)) problems.push(`tool '${name}' is not a route name`);
  }
  for (const start of def.sessionStarts ?? DEFAULT_SESSION_STARTS) {
    const isTool = Object.keys(def.tools).some((name) => toolRoute(name) === start);
    if (start !== SEED_ROUTE && !isTool) {
      problems.push(`declared session start '${start}' is neither ${SEED_ROUTE} nor a tool route`);
    }
  }
  return problems;
}

const noopHook = async (): Promise<void> => {};

/**
 * Checks a definition at startup, checkpointing on or off: a typo in a declaration, an `exported`
 * server without its hooks, or a bad route would otherwise act silently as something else.
 */
export function checkDefinition(def: ResourcesServerDefinition): Declarations {
  const mode = checkpointModeOf(def);
  const verify = verifyModeOf(def);
  if (mode === 'exported') {
    const missing = missingHooks(def);
    if (missing.length > 0) {
      throw new ConfigError(
        `resources server '${def.app}': checkpoint_mode "exported" but it does not implement ${missing.join(', ')}`,
      );
    }
  }
  const problems = routeProblems(def);
  if (problems.length > 0) {
    throw new ConfigError(`resources server '${def.app}': ${problems.join('; ')}`);
  }
  const hooks = def.hooks ?? {};
  return {
    mode,
    verify,
    sessionStarts: [...(def.sessionStarts ?? DEFAULT_SESSION_STARTS)],
    hooks: {
      exportSessionStates:
        hooks.exportSessionStates?.bind(hooks) ??
        (async (): Promise<Record<string, JsonValue>> => ({})),
      restoreSessionStates: hooks.restoreSessionStates?.bind(hooks) ?? noopHook,
      // Called in every mode; the default frees nothing.
      retireSessionState: hooks.retireSessionState?.bind(hooks) ?? noopHook,
    },
  };
}
