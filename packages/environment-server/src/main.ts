#!/usr/bin/env node
/**
 * CLI entry: `environment-server --config <stack file> --server <name>`. Prints one JSON
 * "listening" line on stdout; SIGTERM/SIGINT stop accepting, let running requests finish, exit.
 */
import { realpathSync } from 'node:fs';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';

import { ConfigError, listen, loadStackFile } from '@ckpt-gym/core';

import { environmentServerFromStack } from './registry.js';

export interface RunningCli {
  readonly url: string;
  /** Stops accepting, waits for running requests, closes the HTTP pools. */
  stop(): Promise<void>;
}

/** Starts the server named by `--server` from the stack file `--config`. */
export async function startCli(
  argv: readonly string[],
  print: (line: string) => void = (line) => void process.stdout.write(`${line}\n`),
): Promise<RunningCli> {
  const { values } = parseArgs({
    args: [...argv],
    options: { config: { type: 'string' }, server: { type: 'string' } },
  });
  if (!values.config || !values.server) {
    throw new ConfigError('usage: environment-server --config <stack file> --server <name>');
  }
  const stack = loadStackFile(values.config);
  const { server, settings, clients } = environmentServerFromStack(stack, values.server);
  const listening = await listen(server.app, settings.port, settings.host);
  print(
    JSON.stringify({
      event: 'listening',
      server: settings.name,
      kind: 'environment',
      app: settings.app,
      url: listening.url,
      port: listening.port,
      checkpointing: stack.checkpoint !== undefined,
    }),
  );
  let stopping: Promise<void> | undefined;
  return {
    url: listening.url,
    stop() {
      stopping ??= (async () => {
        server.logger.info('draining');
        await listening.close();
        clients.close();
      })();
      return stopping;
    },
  };
}

function isEntry(): boolean {
  const script = process.argv[1];
  if (!script) return false;
  try {
    return import.meta.url === pathToFileURL(realpathSync(script)).href;
  } catch {
    return false;
  }
}

if (isEntry()) {
  startCli(process.argv.slice(2)).then(
    (cli) => {
      const stop = () => void cli.stop().then(() => process.exit(0));
      process.once('SIGTERM', stop);
      process.once('SIGINT', stop);
    },
    (err: unknown) => {
      process.stderr.write(`${err instanceof Error ? err.message : String(err)}\n`);
      process.exit(1);
    },
  );
}
