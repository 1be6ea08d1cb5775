/**
 * One server of a stack file, built by its kind and app and listening: what `ckpt-gym serve`
 * runs (and so what `up` and the containers run). Each server package is imported only when a
 * server of its kind is served, so every other command starts without loading them all.
 */
import {
  ConfigError,
  listen,
  type Logger,
  MCP_EXPOSURE_KEY,
  serverSettings,
  type ServerKind,
  type ServerSettings,
  type StackSettings,
} from '@ckpt-gym/core';
import type { ScriptName } from '@ckpt-gym/fake-inference';

/** The inference app this CLI can run itself; any other inference entry is an external backend. */
export const FAKE_INFERENCE_APP = 'fake';

export interface ServingServer {
  readonly name: string;
  readonly kind: ServerKind;
  readonly host: string;
  readonly port: number;
  readonly url: string;
  /** Stops accepting, lets requests in flight finish, releases timers and pools. */
  close(): Promise<void>;
}

/** Whether `serve` can run this entry (an external inference backend is not ours to run). */
export function isRunnable(server: ServerSettings): boolean {
  return server.kind !== 'inference' || server.app === FAKE_INFERENCE_APP;
}

function fakeScript(
  server: ServerSettings,
  scripts: Readonly<Record<string, unknown>>,
): ScriptName | undefined {
  const script = server.config.script;
  if (script === undefined) return undefined;
  if (typeof script !== 'string' || !Object.hasOwn(scripts, script)) {
    throw new ConfigError(
      `servers.${server.name}.script: must be one of ${Object.keys(scripts).join(', ')}`,
    );
  }
  return script as ScriptName;
}

/** Builds the named server and listens on its host and port. */
export async function serveServer(
  stack: StackSettings,
  name: string,
  options: { logger?: Logger } = {},
): Promise<ServingServer> {
  const settings = serverSettings(stack, name);
  const { host, port, kind } = settings;
  const done = (listening: { port: number; url: string }, close: () => Promise<void>) => ({
    name,
    kind,
    host,
    port: listening.port,
    url: listening.url,
    close,
  });
  switch (kind) {
    case 'inference': {
      if (!isRunnable(settings)) {
        throw new ConfigError(
          `servers.${name}: inference app '${settings.app}' is an external backend; ` +
            `only app: ${FAKE_INFERENCE_APP} can be served`,
        );
      }
      const { SCRIPTS, startFakeInference } = await import('@ckpt-gym/fake-inference');
      const model = settings.config.model;
      const fake = await startFakeInference({
        name,
        port,
        host,
        script: fakeScript(settings, SCRIPTS),
        ...(typeof model === 'string' ? { model } : {}),
      });
      return done(fake, () => fake.close());
    }
    case 'resources': {
      const secret = settings.config.session_secret;
      if (secret !== undefined && (typeof secret !== 'string' || secret === '')) {
        throw new ConfigError(`servers.${name}.session_secret: must be a non-empty string`);
      }
      const { createResourcesServer, definitionFor } = await import('@ckpt-gym/resources-server');
      const server = createResourcesServer(definitionFor(settings, stack.baseDir), {
        name,
        checkpoint: stack.checkpoint,
        logger: options.logger,
        exposeToolsOverMcp: settings.config[MCP_EXPOSURE_KEY] === true,
        sessionSecret: secret,
      });
      const listening = await listen(server.app, port, host);
      return done(listening, async () => {
        server.plane?.dispose();
        await listening.close();
      });
    }
    case 'model': {
      const { createPolicyModelServer } = await import('@ckpt-gym/policy-model-server');
      const model = await createPolicyModelServer(settings, stack, options);
      const listening = await listen(model.app, port, host);
      return done(listening, async () => {
        model.plane?.dispose();
        const closed = listening.close();
        // Held generations never end by themselves; a drain must not wait for them.
        listening.server.closeAllConnections();
        await closed;
      });
    }
    case 'agent': {
      const { createAgentServerFromStack } = await import('@ckpt-gym/agent-server');
      const agent = createAgentServerFromStack(stack, name, options);
      const listening = await listen(agent.app, port, host);
      return done(listening, async () => {
        await listening.close();
        agent.close();
      });
    }
    case 'environment': {
      const { environmentServerFromStack } = await import('@ckpt-gym/environment-server');
      const { server, clients } = environmentServerFromStack(stack, name, options);
      const listening = await listen(server.app, port, host);
      return done(listening, async () => {
        server.plane?.dispose();
        await listening.close();
        clients.close();
      });
    }
  }
}
