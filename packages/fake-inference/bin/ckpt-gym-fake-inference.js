#!/usr/bin/env node
// The `ckpt-gym-fake-inference` bin. Committed with its execute bit so that npm links it at install
// time, before any build, and a build (or turbo's cache replay of dist/) cannot take the bit away.
import { existsSync } from 'node:fs';
import process from 'node:process';
import { URL } from 'node:url';

const main = new URL('../dist/cli.js', import.meta.url);
if (!existsSync(main)) {
  process.stderr.write('ckpt-gym-fake-inference: not built yet; run npm run build first\n');
  process.exit(1);
}
await import(main.href);
