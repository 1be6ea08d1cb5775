#!/usr/bin/env node
// The `ckpt-gym-policy-model` bin: one policy model server of a stack file, through core's one server entry
// (`runServerMain`). Committed with its execute bit, as the ckpt-gym bin is.
import { existsSync } from 'node:fs';
import process from 'node:process';
import { URL } from 'node:url';

const kind = new URL('../dist/kind.js', import.meta.url);
if (!existsSync(kind)) {
  process.stderr.write('ckpt-gym-policy-model: not built yet; run npm run build first\n');
  process.exit(1);
}
const [{ runServerMain }, { policyModelKind }] = await Promise.all([
  import('@ckpt-gym/core/server'),
  import(kind.href),
]);
await runServerMain('ckpt-gym-policy-model', policyModelKind);
