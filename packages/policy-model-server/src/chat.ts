/**
 * What the proxy reads of a `/v1/chat/completions` body, checked at the route; everything else
 * passes through to the backend unchanged. The capture lineage digests every message and its tool
 * calls, so a malformed one is refused here as the client's mistake (422, as an OpenAI backend
 * would refuse it) before the call is admitted, never a failure halfway through it.
 */
import { InvalidRequestError } from '@ckpt-gym/core';

type Obj = Record<string, unknown>;

function isObj(value: unknown): value is Obj {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function checkToolCalls(value: unknown, path: string): void {
  if (value === undefined || value === null) return;
  if (!Array.isArray(value)) throw new InvalidRequestError(`${path}: must be a list`);
  value.forEach((call, i) => {
    const fn = isObj(call) ? call.function : undefined;
    if (!isObj(fn) || typeof fn.name !== 'string' || typeof fn.arguments !== 'string') {
      throw new InvalidRequestError(
        `${path}[${i}].function: must be an object with string name and arguments`,
      );
    }
  });
}

/** `body` when its messages are a non-empty list of objects with a role and well-formed tool calls. */
export function checkChatRequest(body: Obj): Obj {
  const messages = body.messages;
  if (!Array.isArray(messages) || messages.length === 0) {
    throw new InvalidRequestError('messages: must be a non-empty list');
  }
  messages.forEach((message, i) => {
    if (!isObj(message) || typeof message.role !== 'string') {
      throw new InvalidRequestError(`messages[${i}]: must be an object with a string role`);
    }
    checkToolCalls(message.tool_calls, `messages[${i}].tool_calls`);
  });
  return body;
}
