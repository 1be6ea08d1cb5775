#!/usr/bin/env node
// The `ckpt-gym` bin. Committed with its execute bit so that npm links it at install time, before
// any build, and a build (or turbo's cache replay of dist/) cannot take the bit away.
import { existsSync } from 'node:fs';
import process from 'node:process';
import { clearInterval, setInterval } from 'node:timers';
import { URL } from 'node:url';

const main = new URL('../dist/main.js', import.meta.url);
if (!existsSync(main)) {
  process.stderr.write('ckpt-gym: not built yet; run npm run build first\n');
  process.exit(1);
}

// Under npx and `npm run` the process tree is npm → `sh -c` → this node. A SIGTERM sent to npm
// reaches the shell, which dies without passing it on, and this process is left orphaned: so
// the wrapper's death is this process's SIGTERM (a collection checkpoints with stop, exit 75).
const WRAPPER_POLL_MS = 500;
if (process.env.npm_command !== undefined) {
  const wrapper = process.ppid;
  const watch = setInterval(() => {
    if (process.ppid === wrapper) return;
    clearInterval(watch);
    process.kill(process.pid, 'SIGTERM');
  }, WRAPPER_POLL_MS);
  watch.unref();
}
await import(main.href);
