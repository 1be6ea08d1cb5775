/**
 * One server of a stack file, built by its kind and app and listening: what `ckpt-gym serve`
 * runs (and so what `up` and the containers run). `serve` is a lookup over the server packages'
 * kinds; each kind builds, listens and closes its servers its own way, and core's `startServer`
 * runs a server with `num_workers: N` as a primary and N forked workers.
 */
import { agentKind } from '@ckpt-gym/agent-server';
import {
  type FromStackOptions,
  type GymServer,
  kindSchemas,
  type KindConfigSchemas,
  type ServerKind,
  type ServerKindModule,
  serverSettings,
  type ServerSettings,
  type RunningServer,
  type StackSettings,
  startServer,
} from '@ckpt-gym/core/server';
import { environmentKind } from '@ckpt-gym/environment-server';
import { FAKE_INFERENCE_APP, fakeInferenceKind } from '@ckpt-gym/fake-inference';
import { policyModelKind } from '@ckpt-gym/policy-model-server';
import { resourcesKind } from '@ckpt-gym/resources-server';

export { FAKE_INFERENCE_APP };

/** Every kind's module, by kind: a kind without one (or a module of another kind) does not compile. */
export const SERVER_KIND_MODULES: { readonly [K in ServerKind]: ServerKindModule<K> } = {
  inference: fakeInferenceKind,
  model: policyModelKind,
  resources: resourcesKind,
  agent: agentKind,
  environment: environmentKind,
};

/** What the CLI checks every stack file it loads against. */
export const KIND_SCHEMAS: KindConfigSchemas = kindSchemas(Object.values(SERVER_KIND_MODULES));

export type ServingServer = GymServer;

/** Whether `serve` can run this entry (an external inference backend is not ours to run). */
export function isRunnable(server: ServerSettings): boolean {
  return server.kind !== 'inference' || server.app === FAKE_INFERENCE_APP;
}

/**
 * The process of `ckpt-gym serve`: the named server of the stack, with its workers when it runs
 * several (a forked worker re-runs the same command line and gets its share); `print` gets the
 * listening line, in the primary only.
 */
export function serveProcess(
  stack: StackSettings,
  name: string,
  print: (line: string) => void,
): Promise<RunningServer> {
  const { kind } = serverSettings(stack, name);
  return startServer(SERVER_KIND_MODULES[kind], stack, name, {}, print);
}

/** Builds the named server in this process (one process, whatever its `num_workers`). */
export function serveServer(
  stack: StackSettings,
  name: string,
  options: FromStackOptions = {},
): Promise<ServingServer> {
  const { kind } = serverSettings(stack, name);
  return SERVER_KIND_MODULES[kind].fromStack(stack, name, options);
}
