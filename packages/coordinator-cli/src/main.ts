#!/usr/bin/env node
// The `ckpt-gym` bin: runs the command line and exits with its code.
import { runCli } from './index.js';

// A reader that went away (`ckpt-gym status --watch | head -n 1`) ends the command quietly, as
// a shell tool does, rather than with an unhandled EPIPE and its stack trace.
process.stdout.on('error', (err: NodeJS.ErrnoException) => {
  if (err.code !== 'EPIPE') throw err;
  process.exit(0);
});

const code = await runCli(process.argv.slice(2));
process.exitCode = code;
// A server's leftover timers or sockets must not keep a finished command alive; the delay lets
// stdout drain first.
setTimeout(() => process.exit(code), 2000).unref();
