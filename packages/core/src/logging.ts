/**
 * Logging: one JSON line per entry (timestamp, level, message, context), through winston. A
 * server's logger carries its name and kind; `child()` adds per-episode context such as the
 * capture key and the checkpoint id, so every line of an episode can be found by grep.
 */
import winston from 'winston';

import { ConfigError } from './errors.js';

export const LOG_LEVEL_ENV = 'CKPT_GYM_LOG_LEVEL';
export const DEFAULT_LOG_LEVEL = 'info';
/** winston's npm levels, most severe first. */
export const LOG_LEVELS = ['error', 'warn', 'info', 'http', 'verbose', 'debug', 'silly'] as const;
export type LogLevel = (typeof LOG_LEVELS)[number];

export type LogMeta = Record<string, unknown>;

/** What every module logs through; a winston logger satisfies it, and so can a test double. */
export interface Logger {
  error(message: string, meta?: LogMeta): void;
  warn(message: string, meta?: LogMeta): void;
  info(message: string, meta?: LogMeta): void;
  debug(message: string, meta?: LogMeta): void;
  child(meta: LogMeta): Logger;
}

export interface LoggerContext {
  server?: string;
  kind?: string;
  /** Overrides `CKPT_GYM_LOG_LEVEL`. */
  level?: string;
  /** Where the JSON lines go (default: stdout). */
  stream?: NodeJS.WritableStream;
  /** Read for `CKPT_GYM_LOG_LEVEL` (default: `process.env`). */
  env?: Readonly<Record<string, string | undefined>>;
}

/** The level to log at; an unknown name is a `ConfigError` rather than silently logging nothing. */
export function resolveLogLevel(
  level: string | undefined,
  env: Readonly<Record<string, string | undefined>> = process.env,
): LogLevel {
  const fromEnv = env[LOG_LEVEL_ENV];
  const chosen = (level ?? (fromEnv === undefined || fromEnv === '' ? DEFAULT_LOG_LEVEL : fromEnv))
    .trim()
    .toLowerCase();
  if ((LOG_LEVELS as readonly string[]).includes(chosen)) return chosen as LogLevel;
  const origin = level === undefined ? LOG_LEVEL_ENV : 'log level';
  throw new ConfigError(
    `${origin}: unknown level ${JSON.stringify(chosen)} (levels: ${LOG_LEVELS.join(', ')})`,
  );
}

/**
 * JSON.stringify drops an Error's message and stack (they are not own enumerable keys), and
 * bigint has no JSON form; both would make a log line useless or throw.
 */
function logReplacer(_key: string, value: unknown): unknown {
  if (typeof value === 'bigint') return value.toString();
  if (value instanceof Error) {
    const code = (value as { code?: unknown }).code;
    return {
      name: value.name,
      message: value.message,
      ...(code === undefined ? {} : { code }),
      stack: value.stack,
    };
  }
  return value;
}

export function createLogger(context: LoggerContext = {}): Logger {
  const defaultMeta: LogMeta = {};
  if (context.server !== undefined) defaultMeta.server = context.server;
  if (context.kind !== undefined) defaultMeta.kind = context.kind;
  return winston.createLogger({
    level: resolveLogLevel(context.level, context.env),
    levels: winston.config.npm.levels,
    defaultMeta,
    format: winston.format.combine(
      winston.format.timestamp(),
      winston.format.json({ replacer: logReplacer }),
    ),
    transports: [new winston.transports.Stream({ stream: context.stream ?? process.stdout })],
  });
}
