/** The version of this package, from its package.json (one level above both src/ and dist/). */
import { readFileSync } from 'node:fs';

export function packageVersion(): string {
  const manifest = new URL('../package.json', import.meta.url);
  return (JSON.parse(readFileSync(manifest, 'utf8')) as { version: string }).version;
}
