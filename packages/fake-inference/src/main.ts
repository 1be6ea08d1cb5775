#!/usr/bin/env node
/**
 * `ckpt-gym-fake-inference --port N --host H [--model M] [--script weather|counter]
 * [--keepalive-ms N]`: runs the fake backend as its own process, so its call log and token store
 * outlive a crash of every gym process. Prints one JSON line `{"event":"listening",…}` to stdout
 * once it accepts calls, and exits 0 on SIGTERM or SIGINT.
 */
import { parseArgs } from 'node:util';

import { type ListenOptions, startFakeInference } from './app.js';
import { SCRIPTS, type ScriptName } from './script.js';

function fail(message: string): never {
  process.stderr.write(`ckpt-gym-fake-inference: ${message}\n`);
  process.exit(2);
}

function integerOption(name: string, value: string | undefined, max: number): number | undefined {
  if (value === undefined) return undefined;
  const n = Number(value);
  if (!/^\d+$/.test(value) || n > max)
    fail(`--${name} must be an integer from 0 to ${max}, got ${value}`);
  return n;
}

function parseCli(argv: string[]): ListenOptions {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        port: { type: 'string' },
        host: { type: 'string' },
        model: { type: 'string' },
        script: { type: 'string' },
        'keepalive-ms': { type: 'string' },
      },
      strict: true,
    }));
  } catch (err) {
    fail((err as Error).message);
  }
  const { script } = values;
  if (script !== undefined && !Object.hasOwn(SCRIPTS, script)) {
    fail(`--script must be one of ${Object.keys(SCRIPTS).join(', ')}, got ${script}`);
  }
  return {
    port: integerOption('port', values.port, 65_535),
    host: values.host,
    model: values.model,
    script: script as ScriptName | undefined,
    keepAliveMs: integerOption('keepalive-ms', values['keepalive-ms'], 2 ** 31 - 1),
    logger: {
      error: (message, meta) =>
        process.stderr.write(`${JSON.stringify({ event: 'error', message, ...meta })}\n`),
    },
  };
}

const running = await startFakeInference(parseCli(process.argv.slice(2))).catch((err: unknown) => {
  process.stderr.write(`ckpt-gym-fake-inference: cannot listen: ${(err as Error).message}\n`);
  process.exit(1);
});
process.stdout.write(
  `${JSON.stringify({ event: 'listening', host: running.host, port: running.port, url: running.url })}\n`,
);

let stopping = false;
const stop = (): void => {
  if (stopping) return;
  stopping = true;
  running.close().then(
    () => process.exit(0),
    (err: unknown) => {
      process.stderr.write(`ckpt-gym-fake-inference: close failed: ${String(err)}\n`);
      process.exit(1);
    },
  );
};
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
