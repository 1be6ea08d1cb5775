#!/usr/bin/env node
/**
 * `ckpt-gym-agent --config <stack file> --server <name>`: runs one agent server of a stack. Prints
 * one JSON line `{"event":"listening",…}` once it accepts calls; SIGTERM or SIGINT stops accepting,
 * lets in-flight requests finish, and exits 0.
 */
import { parseArgs } from 'node:util';

import { CkptGymError, listen, loadStackFile } from '@ckpt-gym/core';

import { createAgentServerFromStack } from './registry.js';

function fail(message: string, code = 2): never {
  process.stderr.write(`ckpt-gym-agent: ${message}\n`);
  process.exit(code);
}

let values: { config?: string; server?: string };
try {
  ({ values } = parseArgs({
    args: process.argv.slice(2),
    options: { config: { type: 'string' }, server: { type: 'string' } },
    strict: true,
  }));
} catch (err) {
  fail((err as Error).message);
}
if (!values.config || !values.server) fail('usage: --config <stack file> --server <name>');

let agent;
let settings;
try {
  const stack = loadStackFile(values.config);
  settings = stack.servers.get(values.server);
  agent = createAgentServerFromStack(stack, values.server);
} catch (err) {
  fail(err instanceof CkptGymError ? err.message : String(err));
}
const running = await listen(agent.app, settings!.port, settings!.host).catch((err: unknown) =>
  fail(`cannot listen: ${(err as Error).message}`, 1),
);
process.stdout.write(
  `${JSON.stringify({ event: 'listening', server: values.server, kind: 'agent', host: running.host, port: running.port, url: running.url })}\n`,
);

let stopping = false;
const stop = (): void => {
  if (stopping) return;
  stopping = true;
  running.close().then(
    () => {
      agent.close();
      process.exit(0);
    },
    (err: unknown) => fail(`close failed: ${String(err)}`, 1),
  );
};
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
