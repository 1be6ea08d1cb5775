#!/usr/bin/env node
/**
 * `ckpt-gym-resources --config <stack file> --server <name>`: runs one resources server of a stack
 * file. Prints one JSON line `{"event":"listening",…}` once it accepts requests; on SIGTERM or
 * SIGINT it stops accepting, lets requests in flight finish, and exits 0.
 */
import { parseArgs } from 'node:util';

import { startFromStackFile, type StartedResourcesServer } from './start.js';

function fail(message: string, code = 2): never {
  process.stderr.write(`ckpt-gym-resources: ${message}\n`);
  process.exit(code);
}

function parseCli(argv: string[]): { config: string; server: string } {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: { config: { type: 'string' }, server: { type: 'string' } },
      strict: true,
    }));
  } catch (err) {
    fail((err as Error).message);
  }
  if (!values.config || !values.server) fail('usage: --config <stack file> --server <name>');
  return { config: values.config, server: values.server };
}

const cli = parseCli(process.argv.slice(2));
let started: StartedResourcesServer;
try {
  started = await startFromStackFile(cli.config, cli.server);
} catch (err) {
  fail((err as Error).message, 1);
}
const { listening } = started;
process.stdout.write(
  `${JSON.stringify({ event: 'listening', server: cli.server, host: listening.host, port: listening.port, url: listening.url })}\n`,
);

let stopping = false;
const stop = (): void => {
  if (stopping) return;
  stopping = true;
  started.close().then(
    () => process.exit(0),
    (err: unknown) => fail(`close failed: ${String(err)}`, 1),
  );
};
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
