#!/usr/bin/env node
// The `ckpt-gym` bin: runs the command line and exits with its code.
import { runCli } from './index.js';

const code = await runCli(process.argv.slice(2));
process.exitCode = code;
// A server's leftover timers or sockets must not keep a finished command alive; the delay lets
// stdout drain first.
setTimeout(() => process.exit(code), 2000).unref();
