/* global console, process */
// What the benchmarks share for their flags and their child processes.
import { readFileSync } from 'node:fs';
import { basename } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

/** The running benchmark's name in its messages: its file's name without `.mjs`. */
let bench = basename(process.argv[1] ?? 'bench', '.mjs');

/**
 * The flags of the benchmark at `url` (its `import.meta.url`): parseArgs's `values` for `options`,
 * plus `--help` (`-h`), which prints the file's leading `//` comment without its `// ` and exits 0.
 * A flag parseArgs refuses is one line and exit 2 (`refuse`).
 */
export function benchFlags(url, { options }) {
  const file = fileURLToPath(url);
  bench = basename(file, '.mjs');
  let values;
  try {
    ({ values } = parseArgs({ options: { ...options, help: { type: 'boolean', short: 'h' } } }));
  } catch (error) {
    refuse(error.message.replaceAll('\n', ' '));
  }
  if (values.help) {
    console.log(usage(file));
    process.exit(0);
  }
  return values;
}

/** A file's leading comment: its `//` lines, after a first `/* global` line if it has one. */
function usage(file) {
  const lines = readFileSync(file, 'utf8').split('\n');
  if (lines[0].startsWith('/* global')) lines.shift();
  const end = lines.findIndex((line) => !line.startsWith('//'));
  return lines
    .slice(0, end)
    .map((line) => line.replace(/^\/\/ ?/, ''))
    .join('\n');
}

/** Stops the benchmark on a bad flag: `<bench>: <message> (--help for usage)`, exit 2. */
export function refuse(message) {
  console.error(`${bench}: ${message} (--help for usage)`);
  process.exit(2);
}

/** Flag `name` as an integer of at least `least`. */
export function integerFlag(flags, name, least) {
  const value = Number(flags[name]);
  if (!Number.isSafeInteger(value) || value < least) refuse(`--${name} must be ≥ ${least}`);
  return value;
}

/** The next message a forked child sends. */
export function nextMessage(child) {
  return new Promise((done) => child.once('message', done));
}
