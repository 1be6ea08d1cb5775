/**
 * Waiting for a state, never for a time: `until` is the one poll policy of every package's tests,
 * and `deadline` the one way to write a control call's `deadline_ts`.
 */
import { setTimeout as sleep } from 'node:timers/promises';

/** How often `until` checks: short, so a test goes on as soon as the state is reached. */
export const POLL_MS = 5;

/** `until`'s bound: below jest's 30 s test timeout, so a stuck wait fails with its own message. */
export const UNTIL_TIMEOUT_MS = 20_000;

/** Thrown when `until` gives up: it names what the test waited for. */
export class UntilTimeoutError extends Error {
  constructor(
    readonly what: string,
    readonly timeoutMs: number,
  ) {
    super(`timed out after ${timeoutMs} ms waiting for ${what}`);
    this.name = 'UntilTimeoutError';
  }
}

/**
 * Resolves once `check` holds (sync or async), checking every POLL_MS; rejects with an
 * `UntilTimeoutError` naming `what` after `timeoutMs`. No test asserts on how long this took.
 */
export async function until(
  check: () => boolean | Promise<boolean>,
  what = 'condition',
  timeoutMs = UNTIL_TIMEOUT_MS,
): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() >= end) throw new UntilTimeoutError(what, timeoutMs);
    await sleep(POLL_MS);
  }
}

/** A control call's `deadline_ts`: `seconds` from now, in epoch seconds. */
export function deadline(seconds = 30): number {
  return Date.now() / 1000 + seconds;
}
