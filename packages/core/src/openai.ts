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
function checkToolCalls(value: unknown, path: string): void {
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

/**
 * A chat request's `messages` are a non-empty list of objects with a string role and well-formed
 * tool calls; anything else is 422 `invalid_request` naming the first bad path.
 */
export function checkChatMessages(messages: unknown): void {
  if (!Array.isArray(messages) || messages.length === 0) {
    throw new InvalidRequestError('messages: must be a non-empty array');
  }
  messages.forEach((message, i) => {
    if (!isPlainObject(message) || typeof message.role !== 'string') {
      throw new InvalidRequestError(`messages[${i}]: must be an object with a string role`);
    }
    checkToolCalls(message.tool_calls, `messages[${i}].tool_calls`);
  });
}
