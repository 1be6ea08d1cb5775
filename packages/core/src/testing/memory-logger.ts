/** A logger that keeps its lines for assertions and prints nothing. */
import type { Logger, LogMeta } from '../logging.js';

export interface LogLine {
  level: string;
  message: string;
  meta: LogMeta;
}

export class MemoryLogger implements Logger {
  constructor(
    private readonly context: LogMeta = {},
    /** Shared with children, so a test sees every line in one place. */
    readonly lines: LogLine[] = [],
  ) {}

  #log(level: string, message: string, meta: LogMeta = {}): void {
    this.lines.push({ level, message, meta: { ...this.context, ...meta } });
  }

  error(message: string, meta?: LogMeta): void {
    this.#log('error', message, meta);
  }

  warn(message: string, meta?: LogMeta): void {
    this.#log('warn', message, meta);
  }

  info(message: string, meta?: LogMeta): void {
    this.#log('info', message, meta);
  }

  debug(message: string, meta?: LogMeta): void {
    this.#log('debug', message, meta);
  }

  child(meta: LogMeta): Logger {
    return new MemoryLogger({ ...this.context, ...meta }, this.lines);
  }
}
