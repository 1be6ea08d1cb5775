/**
 * The chat-completions body a policy model server sends its backend worker (OpenAI's, plus the
 * `ng_capture` admission of a captured call). Fields the worker does not read (tools, temperature,
 * other `ng_*` extensions) pass unchecked, as a lenient backend accepts them.
 */
import type { CaptureAdmission } from '../capture/wire.js';
import type { JsonObject, JsonValue } from '../json.js';
import { checkChatMessages } from '../openai.js';
import { compileWire } from './validate.js';

export interface ChatCompletionRequest {
  model?: string;
  /** Well-formed as `checkChatMessages` says. */
  messages: JsonObject[];
  stream?: boolean;
  /** `include_usage`: a last chunk with usage and no choices. */
  stream_options?: { include_usage?: JsonValue } | null;
  /**
   * A captured call's `CaptureAdmission`, unchecked here: the worker's capture path reads it with
   * `parseCaptureAdmission` and refuses a bad one in its own reply, not with a 422.
   */
  ng_capture?: CaptureAdmission | JsonValue;
  [field: string]: unknown;
}

const CHAT_SCHEMA = {
  type: 'object',
  reason: 'must be a JSON object',
  properties: {
    model: { type: 'string', reason: 'must be a string' },
    stream: { type: 'boolean', reason: 'must be a boolean' },
    stream_options: { type: ['object', 'null'], reason: 'must be an object' },
  },
} as const;

const checkChat = compileWire<ChatCompletionRequest>(CHAT_SCHEMA);

/** Reads a chat-completions body; a bad one is 422 `invalid_request` naming the field. */
export function parseChatCompletionRequest(body: unknown): ChatCompletionRequest {
  const chat = checkChat(body);
  checkChatMessages(chat.messages);
  return chat;
}
