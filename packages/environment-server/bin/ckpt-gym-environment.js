#!/usr/bin/env node
// The `ckpt-gym-environment` bin: one environment server of a stack file, through core's one server entry
// (`runServerMain`). Committed with its execute bit, as the ckpt-gym bin is.
import { existsSync } from 'node:fs';
import process from 'node:process';
import { URL } from 'node:url';

const kind = new URL('../dist/kind.js', import.meta.url);
if (!existsSync(kind)) {
  process.stderr.write('ckpt-gym-environment: not built yet; run npm run build first\n');
  process.exit(1);
}
const [{ runServerMain }, { environmentKind }] = await Promise.all([
  import('@ckpt-gym/core/server'),
  import(kind.href),
]);
await runServerMain('ckpt-gym-environment', environmentKind);
