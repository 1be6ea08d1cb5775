import { ConfigError } from '../src/errors.js';
import { type LoggerContext, createLogger, resolveLogLevel } from '../src/logging.js';
import { captureLogLines } from './support/log-lines.js';

/** A logger whose output is collected as parsed JSON lines. */
function capture(context: LoggerContext = {}) {
  const { logger, lines } = captureLogLines(context);
  /** Waits until `count` lines arrived (winston hands entries to transports asynchronously). */
  async function waitFor(count: number): Promise<Record<string, unknown>[]> {
    for (let i = 0; i < 100 && lines.length < count; i++) await new Promise(setImmediate);
    return lines;
  }
  return { logger, lines, waitFor };
}

describe('createLogger', () => {
  it('writes JSON lines with timestamp, level, message and the server context', async () => {
    const { logger, waitFor } = capture({ server: 'policy', kind: 'model' });
    logger.info('listening', { port: 8101 });
    const [line] = await waitFor(1);
    expect(line).toMatchObject({
      level: 'info',
      message: 'listening',
      server: 'policy',
      kind: 'model',
      port: 8101,
    });
    expect(Number.isNaN(Date.parse(String(line?.timestamp)))).toBe(false);
  });

  it('adds child context to every line of the child, not of the parent', async () => {
    const { logger, waitFor } = capture({ server: 'env', kind: 'environment' });
    const episode = logger.child({ capture_key: 'r-a1', checkpoint_id: 'ck-7' });
    episode.warn('parked at boundary', { step: 2 });
    episode.child({ activation: 3 }).error('model call failed');
    logger.info('parent line');
    const lines = await waitFor(3);
    expect(lines).toEqual([
      expect.objectContaining({
        level: 'warn',
        message: 'parked at boundary',
        server: 'env',
        kind: 'environment',
        capture_key: 'r-a1',
        checkpoint_id: 'ck-7',
        step: 2,
      }),
      expect.objectContaining({
        level: 'error',
        message: 'model call failed',
        capture_key: 'r-a1',
        checkpoint_id: 'ck-7',
        activation: 3,
      }),
      expect.objectContaining({ level: 'info', message: 'parent line', server: 'env' }),
    ]);
    expect(lines[2]).not.toHaveProperty('capture_key');
  });

  it('leaves out context fields it was not given', async () => {
    const { logger, waitFor } = capture();
    logger.info('bare');
    const [line] = await waitFor(1);
    expect(Object.keys(line ?? {}).sort()).toEqual(['level', 'message', 'timestamp']);
  });

  it('logs at info by default, dropping debug', async () => {
    const { logger, waitFor } = capture();
    logger.debug('hidden');
    logger.info('shown');
    const lines = await waitFor(1);
    expect(lines.map((line) => line.message)).toEqual(['shown']);
  });

  it('takes the level from CKPT_GYM_LOG_LEVEL', async () => {
    const { logger, waitFor } = capture({ env: { CKPT_GYM_LOG_LEVEL: 'debug' } });
    logger.debug('shown');
    const lines = await waitFor(1);
    expect(lines.map((line) => line.message)).toEqual(['shown']);
  });

  it('lets an explicit level override the environment', async () => {
    const { logger, waitFor } = capture({ level: 'warn', env: { CKPT_GYM_LOG_LEVEL: 'debug' } });
    logger.info('hidden');
    logger.warn('shown');
    const lines = await waitFor(1);
    expect(lines.map((line) => line.message)).toEqual(['shown']);
  });

  it('writes errors in meta with their message, code and stack, and bigints as strings', async () => {
    const { logger, waitFor } = capture();
    const err = Object.assign(new Error('disk full'), { code: 'ENOSPC' });
    logger.error('commit failed', { err, records: 2n ** 64n });
    const [line] = await waitFor(1);
    expect(line?.err).toMatchObject({ name: 'Error', message: 'disk full', code: 'ENOSPC' });
    expect(String((line?.err as { stack?: unknown }).stack)).toContain('disk full');
    expect(line?.records).toBe('18446744073709551616');
  });
});

describe('resolveLogLevel', () => {
  it('defaults to info, also for an empty variable', () => {
    expect(resolveLogLevel(undefined, {})).toBe('info');
    expect(resolveLogLevel(undefined, { CKPT_GYM_LOG_LEVEL: '' })).toBe('info');
  });

  it('accepts any case', () => {
    expect(resolveLogLevel(undefined, { CKPT_GYM_LOG_LEVEL: 'DEBUG' })).toBe('debug');
  });

  it('refuses an unknown level, naming the variable', () => {
    expect(() => resolveLogLevel(undefined, { CKPT_GYM_LOG_LEVEL: 'loud' })).toThrow(
      new ConfigError(
        'CKPT_GYM_LOG_LEVEL: unknown level "loud" (levels: error, warn, info, http, verbose, debug, silly)',
      ),
    );
    expect(() => createLogger({ level: 'loud', env: {} })).toThrow(ConfigError);
  });
});
