/**
 * The stack files of the e2e deployments: one YAML text per shape, `port: 0` for every server but
 * the fake backend (the policy model names it by URL, so its port is the caller's). Relative paths
 * resolve against the run directory, where the file is written.
 */

export const TOKEN = 'e2e-checkpoint-token';

export type StackShape = 'native' | 'native_mcp' | 'legacy' | 'counter' | 'slow' | 'mixed';

export interface StackOptions {
  /** The fake backend's default script (`weather` unless the shape needs another). */
  script?: 'weather' | 'counter';
  /** Token capture (the policy model's ledger) in `<run dir>/capture`. */
  tokenCapture?: boolean;
  /** The slow-verify server's `checkpoint_verify`. */
  checkpointVerify?: 'wait' | 'replay';
  /** `checkpoint_generation_cuts` on the policy model. */
  generationCuts?: boolean;
  /** The policy model's `num_workers` (one process, no coordinator, unless above 1). */
  policyWorkers?: number;
  /** The environment servers' `num_workers` (one process, no coordinator, unless above 1). */
  envWorkers?: number;
  /** Every resources server's `num_workers` (one process unless above 1). */
  resourcesWorkers?: number;
  /** Simple Agent's `num_workers` (one process unless above 1). */
  agentWorkers?: number;
  /**
   * `mcp`: the resources servers expose their tools over MCP, the environments grant them so
   * and Simple Agent takes them over MCP (`direct_http` by default).
   */
  tools?: 'direct_http' | 'mcp';
  /** `telemetry.traces.rollout_sample_ratio` (unset: the default, every rollout). */
  rolloutSampleRatio?: number;
}

/** Files the slow-verify server reads and writes, relative to the run directory. */
export const SLOW_VERIFY_FLAG = 'slow-verify.flag';
export const SLOW_VERIFY_LOG = 'slow-verify.log';

function server(name: string, fields: Record<string, string | number | boolean>): string {
  const body = Object.entries(fields)
    .map(
      ([key, value]) =>
        `${key}: ${typeof value === 'string' ? JSON.stringify(value) : String(value)}`,
    )
    .join(', ');
  return `  ${name}: { ${body} }`;
}

/**
 * The servers every shape shares: the fake backend, the policy model and Simple Agent. The
 * backend's port is fixed up front: the policy model names it by URL, which no launcher rewrites.
 */
function common(options: StackOptions, agentResources: string, inferencePort: number): string[] {
  return [
    server('inference', {
      kind: 'inference',
      app: 'fake',
      port: inferencePort,
      script: options.script ?? 'weather',
    }),
    server('policy', {
      kind: 'model',
      app: 'policy',
      port: 0,
      backend_url: `http://127.0.0.1:${inferencePort}/v1`,
      checkpoint_policy: true,
      checkpoint_generation_cuts: options.generationCuts ?? false,
      ...(options.policyWorkers === undefined ? {} : { num_workers: options.policyWorkers }),
    }),
    server('simple_agent', {
      kind: 'agent',
      app: 'simple',
      port: 0,
      model_server: 'policy',
      resources_server: agentResources,
      ...(options.tools === 'mcp' ? { tool_transport: 'mcp' } : {}),
      ...(options.agentWorkers === undefined ? {} : { num_workers: options.agentWorkers }),
    }),
  ];
}

function environment(
  name: string,
  resources: string,
  app = 'single_agent_turn',
  options: StackOptions = {},
  agent = 'simple_agent',
): string {
  const line = server(name, {
    kind: 'environment',
    app,
    port: 0,
    agent_server: agent,
    resources_server: resources,
    ...(options.envWorkers === undefined ? {} : { num_workers: options.envWorkers }),
  });
  // A list, which `server` does not write.
  return options.tools === 'mcp'
    ? line.replace(/ }$/, ', resources_tool_transports: [mcp] }')
    : line;
}

/** A resources server's entry, its tools over MCP when `options.tools` says so. */
function resources(name: string, app: string, options: StackOptions): string {
  return server(name, {
    kind: 'resources',
    app,
    port: 0,
    ...(options.tools === 'mcp' ? { expose_tools_over_mcp: true } : {}),
    ...(options.resourcesWorkers === undefined ? {} : { num_workers: options.resourcesWorkers }),
  });
}

/** The stack file text for `shape`, with the fake backend on `inferencePort`. */
export function stackYaml(
  shape: StackShape,
  inferencePort: number,
  options: StackOptions = {},
): string {
  const lines = [
    `checkpoint: { enabled: true, control_auth_token: ${TOKEN}, lease_grace_seconds: 600 }`,
    `token_capture: { enabled: ${options.tokenCapture ?? false}, dir: ./capture }`,
    ...(options.rolloutSampleRatio === undefined
      ? []
      : [`telemetry: { traces: { rollout_sample_ratio: ${options.rolloutSampleRatio} } }`]),
    'servers:',
  ];
  switch (shape) {
    case 'native':
      lines.push(
        ...common(options, 'weather', inferencePort),
        resources('weather', 'weather', options),
        environment('env', 'weather', undefined, options),
      );
      break;
    case 'native_mcp':
      // The native stack, and beside it a second agent and environment whose rollouts take the
      // same weather server's tools over MCP.
      lines.push(
        ...common(options, 'weather', inferencePort),
        resources('weather', 'weather', { ...options, tools: 'mcp' }),
        environment('env', 'weather', undefined, { ...options, tools: 'direct_http' }),
        server('mcp_agent', {
          kind: 'agent',
          app: 'simple',
          port: 0,
          model_server: 'policy',
          resources_server: 'weather',
          tool_transport: 'mcp',
          ...(options.agentWorkers === undefined ? {} : { num_workers: options.agentWorkers }),
        }),
        environment('mcp_env', 'weather', undefined, { ...options, tools: 'mcp' }, 'mcp_agent'),
      );
      break;
    case 'legacy':
      // The two legacy entries: Simple Agent's own whole-episode `/run`, and the environment's
      // flat-row adapter over the same agent.
      lines.push(
        ...common(options, 'weather', inferencePort),
        resources('weather', 'weather', options),
        environment('legacy_env', 'weather', 'single_agent_turn_legacy', options),
      );
      break;
    case 'counter':
      lines.push(
        ...common({ ...options, script: 'counter' }, 'counter', inferencePort),
        resources('counter', 'counter', options),
        environment('env', 'counter', undefined, options),
      );
      break;
    case 'slow':
      lines.push(
        ...common(options, 'slow', inferencePort),
        server('slow', {
          kind: 'resources',
          app: 'slow_verify',
          port: 0,
          flag_file: SLOW_VERIFY_FLAG,
          verify_log: SLOW_VERIFY_LOG,
          checkpoint_verify: options.checkpointVerify ?? 'wait',
        }),
        environment('env', 'slow'),
      );
      break;
    case 'mixed':
      lines.push(
        ...common(options, 'weather', inferencePort),
        server('weather', { kind: 'resources', app: 'weather', port: 0 }),
        server('restart_weather', { kind: 'resources', app: 'weather_restart', port: 0 }),
        environment('env', 'weather'),
        environment('restart_env', 'restart_weather'),
      );
      break;
  }
  return `${lines.join('\n')}\n`;
}

/** A native `/run` body for the weather task. */
export function weatherEpisode(rolloutId: string, attempt = 0): Record<string, unknown> {
  return {
    episode_id: { rollout_id: rolloutId, attempt },
    task: {
      task_id: { taskset: 'example_single_tool_call:e2e', task_id: 'weather-sf' },
      task_input: {
        responses_create_params: {
          input: [
            { role: 'developer', content: 'You are a helpful assistant. Use the tools.' },
            { role: 'user', content: 'What is the weather in San Francisco?' },
          ],
          tools: [
            {
              type: 'function',
              name: 'get_weather',
              description: 'The weather forecast for a city.',
              parameters: {
                type: 'object',
                properties: { city: { type: 'string' } },
                required: ['city'],
                additionalProperties: false,
              },
              strict: true,
            },
          ],
        },
        task_data: {},
      },
    },
  };
}

/** A native `/run` body for the counter task: start at 3, add 1 then 2, expect 6. */
export function counterEpisode(rolloutId: string, attempt = 0): Record<string, unknown> {
  return {
    episode_id: { rollout_id: rolloutId, attempt },
    task: {
      task_id: { taskset: 'example_session_state_mgmt:e2e', task_id: 'counter-3-6' },
      task_input: {
        responses_create_params: {
          input: [{ role: 'user', content: 'Add 1 to the counter, then add 2.' }],
        },
        task_data: { initial_count: 3, expected_count: 6 },
      },
    },
  };
}

/** A flat row for Simple Agent's legacy `/run` (weather). */
export function weatherRow(rolloutId: string, attempt = 0): Record<string, unknown> {
  return {
    _ng_rollout_id: rolloutId,
    _ng_attempt_index: attempt,
    responses_create_params: {
      input: [{ role: 'user', content: 'What is the weather in San Francisco?' }],
    },
  };
}
