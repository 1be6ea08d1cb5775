/**
 * `ckpt-gym-fake-inference`: runs the fake backend as its own process, so its call log and token
 * store outlive a crash of every gym process. It takes flags, not a stack file (in a stack,
 * `ckpt-gym serve` starts it through its kind); the process glue is core's. USAGE says the rest.
 */
import { parseArgs } from 'node:util';

import { runServerProcess } from '@ckpt-gym/core/server';

import { DEFAULT_MODEL, type ListenOptions, startFakeInference } from './app.js';
import { SCRIPTS, type ScriptName } from './script.js';

const USAGE = `usage: ckpt-gym-fake-inference [--port N] [--host H] [--model M] [--script NAME] [--keepalive-ms N]

An OpenAI-compatible fake inference backend with scripted tool calls, for tests and demos.
Prints one JSON line {"event":"listening",…} on stdout once it accepts calls; exits 0 on
SIGTERM or SIGINT.

options:
  --port N          port to listen on (default 0: a free port)
  --host H          address to listen on (default 127.0.0.1)
  --model M         the model it lists and answers as (default ${DEFAULT_MODEL})
  --script NAME     the default script: ${Object.keys(SCRIPTS).join(' or ')} (default weather)
  --keepalive-ms N  interval of keep-alive comments on held streamed calls (default 0: none)
  --help, -h        show this help`;

function fail(message: string): never {
  process.stderr.write(`${PROGRAM}: ${message}\n`);
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
        help: { type: 'boolean', short: 'h' },
      },
      strict: true,
    }));
  } catch (err) {
    fail((err as Error).message);
  }
  if (values.help) {
    process.stdout.write(`${USAGE}\n`);
    process.exit(0);
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

const PROGRAM = 'ckpt-gym-fake-inference';

await runServerProcess(PROGRAM, async () => {
  const running = await startFakeInference(parseCli(process.argv.slice(2)));
  process.stdout.write(
    `${JSON.stringify({ event: 'listening', host: running.host, port: running.port, url: running.url })}\n`,
  );
  return running;
});
