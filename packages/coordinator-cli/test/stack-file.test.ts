/** The resolved copy of a stack file that `up` writes into its run directory. */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { loadStack, resolvedStackText, RUN_CAPTURE_DIR } from '../src/stack-file.js';

const STACK = (capture: string) => `
checkpoint: { enabled: false }
${capture}
servers:
  inference: { kind: inference, app: fake, host: 127.0.0.1, port: 9000 }
`;

describe('resolvedStackText', () => {
  let dir: string;
  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), 'stack-file-'));
  });
  afterEach(() => rmSync(dir, { recursive: true, force: true }));

  function resolved(capture: string): string {
    const source = join(dir, 'stack.yaml');
    writeFileSync(source, STACK(capture));
    const runDir = join(dir, 'run');
    const copy = join(dir, 'resolved.yaml');
    writeFileSync(copy, resolvedStackText(source, new Map([['inference', 9100]]), runDir));
    return loadStack(copy, {}).tokenCapture.dir;
  }

  test('a stack that names no capture directory keeps its ledgers in the run directory', () => {
    expect(resolved('token_capture: { enabled: true }')).toBe(join(dir, 'run', RUN_CAPTURE_DIR));
    expect(resolved('')).toBe(join(dir, 'run', RUN_CAPTURE_DIR));
  });

  test('a named capture directory is kept, resolved against the source file', () => {
    expect(resolved('token_capture: { enabled: true, dir: ./ledgers }')).toBe(join(dir, 'ledgers'));
    expect(resolved('token_capture: { dir: /var/ledgers }')).toBe('/var/ledgers');
  });
});
