/**
 * What the proxy reads of a `/v1/chat/completions` body, checked at the route; everything else
 * passes through to the backend unchanged. The capture lineage digests every message and its tool
 * calls, so a malformed one is refused here as the client's mistake (422, as an OpenAI backend
 * would refuse it) before the call is admitted, never a failure halfway through it.
 */
import { checkToolCalls, InvalidRequestError } from '@ckpt-gym/core';

type Obj = Record<string, unknown>;

function isObj(value: unknown): value is Obj {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
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
