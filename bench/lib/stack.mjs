// What the whole-stack benchmarks (scale, throughput) share: a rollout's body and the servers' CPU.
import { readFileSync } from 'node:fs';

/** An environment /run body: the weather task, which the fake backend's `weather` script answers. */
export function episodeBody(rolloutId, attempt, taskset = 'scale') {
  return {
    episode_id: { rollout_id: rolloutId, attempt },
    task: {
      task_id: { taskset, task_id: 'weather-sf' },
      task_input: {
        responses_create_params: {
          input: [{ role: 'user', content: 'What is the weather in San Francisco?' }],
        },
        task_data: {},
      },
    },
  };
}

/**
 * The native stack the throughput benchmarks run (fake backend with no latency, policy model,
 * weather resources, Simple Agent, single_agent_turn environment), checkpointing and token
 * capture on or off.
 */
export function nativeStackYaml(inferencePort, { checkpoint, capture }) {
  const policyFlags = checkpoint
    ? ', checkpoint_policy: true, checkpoint_generation_cuts: true'
    : '';
  return `${checkpoint ? 'checkpoint: { enabled: true, control_auth_token: bench-throughput-token }\n' : ''}${
    capture ? 'token_capture: { enabled: true, dir: ./capture }\n' : ''
  }servers:
  inference: { kind: inference, app: fake, port: ${inferencePort}, script: weather }
  policy: { kind: model, app: policy, port: 0, backend_url: "http://127.0.0.1:${inferencePort}/v1"${policyFlags} }
  weather: { kind: resources, app: weather, port: 0 }
  simple_agent: { kind: agent, app: simple, port: 0, model_server: policy, resources_server: weather }
  env: { kind: environment, app: single_agent_turn, port: 0, agent_server: simple_agent, resources_server: weather }
`;
}

/**
 * CPU time (ms) of each gym server process so far, from /proc (Linux): `total` (user + system) and
 * `kernel` (system only).
 */
export function serverCpuMs(handle) {
  const cpu = { total: {}, kernel: {} };
  for (const server of handle.servers.values()) {
    if (server.kind === 'inference') continue;
    try {
      // Fields after the command name: state is 3rd, utime 14th and stime 15th of the whole line.
      const fields = readFileSync(`/proc/${server.pid}/stat`, 'utf8').split(') ')[1].split(' ');
      const [user, system] = [Number(fields[11]), Number(fields[12])];
      cpu.total[server.name] = ((user + system) * 1000) / 100;
      cpu.kernel[server.name] = (system * 1000) / 100;
    } catch {
      // Not Linux, or the process is gone.
    }
  }
  return cpu;
}

/** Per server, and in all, what `to` adds to `from`. */
export function difference(from, to) {
  const spent = Object.fromEntries(
    Object.keys(to)
      .filter((name) => name in from)
      .map((name) => [name, Math.round(to[name] - from[name])]),
  );
  spent.all = Object.values(spent).reduce((a, b) => a + b, 0);
  return spent;
}
