/** OpenAI chat wire rules shared by every server that reads a chat message's fields. */
import { InvalidRequestError } from './errors.js';

function isPlainObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/**
 * A message's `tool_calls` (at `path`, for the error) are absent or a list of calls whose function
 * name and arguments are strings, as OpenAI's are: both are prompt text and lineage digests them,
 * so anything else is the client's 422 at the route, never a failure halfway through a call.
 */
export function checkToolCalls(value: unknown, path: string): void {
  if (value === undefined || value === null) return;
  if (!Array.isArray(value)) throw new InvalidRequestError(`${path}: must be a list`);
  value.forEach((call, i) => {
    const fn = isPlainObject(call) ? call.function : undefined;
    if (!isPlainObject(fn) || typeof fn.name !== 'string' || typeof fn.arguments !== 'string') {
      throw new InvalidRequestError(
        `${path}[${i}].function: must be an object with string name and arguments`,
      );
    }
  });
}
