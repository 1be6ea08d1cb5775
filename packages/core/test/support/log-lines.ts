import { Writable } from 'node:stream';

import { createLogger, type LoggerContext } from '../../src/logging.js';

/** A logger whose output is collected as parsed JSON lines (no `CKPT_GYM_LOG_LEVEL` read). */
export function captureLogLines(context: LoggerContext = {}) {
  const lines: Record<string, unknown>[] = [];
  const stream = new Writable({
    write(chunk: Buffer, _encoding, done) {
      for (const line of chunk.toString('utf8').split('\n')) {
        if (line !== '') lines.push(JSON.parse(line) as Record<string, unknown>);
      }
      done();
    },
  });
  return { logger: createLogger({ env: {}, ...context, stream }), lines };
}
