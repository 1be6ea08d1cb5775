/** The OpenAI chat-completions wire shapes the fake reads and writes. */
import { parseChatCompletionRequest } from '@ckpt-gym/core/protocol';

import type { AssistantReply, ChatMessage } from './script.js';

export interface ChatRequest {
  readonly model: string | undefined;
  readonly messages: readonly ChatMessage[];
  readonly stream: boolean;
  /** `stream_options.include_usage`: a last chunk with usage and no choices. */
  readonly includeUsage: boolean;
  /** The `ng_capture` extension field, kept verbatim for the call log; null when absent. */
  readonly admission: unknown;
}

/**
 * Reads the fields the fake uses; everything else (tools, temperature, other `ng_*` extension
 * fields) is accepted and ignored, as a lenient backend would. Bad input is 422 `invalid_request`.
 */
export function parseChatRequest(body: unknown): ChatRequest {
  const {
    model,
    messages,
    stream = false,
    stream_options: options,
    ng_capture,
  } = parseChatCompletionRequest(body);
  return {
    model,
    messages: messages as unknown as ChatMessage[],
    stream,
    includeUsage: options?.include_usage === true,
    admission: ng_capture ?? null,
  };
}

export interface Usage {
  readonly prompt_tokens: number;
  readonly completion_tokens: number;
  readonly total_tokens: number;
}

export function usage(promptTokens: number, completionTokens: number): Usage {
  return {
    prompt_tokens: promptTokens,
    completion_tokens: completionTokens,
    total_tokens: promptTokens + completionTokens,
  };
}

export interface CompletionMeta {
  readonly id: string;
  readonly created: number;
  readonly model: string;
}

function assistantMessage(reply: AssistantReply): Record<string, unknown> {
  return reply.finish_reason === 'stop'
    ? { role: 'assistant', content: reply.content }
    : { role: 'assistant', content: null, tool_calls: reply.tool_calls };
}

export function completionBody(meta: CompletionMeta, reply: AssistantReply, use: Usage): object {
  return {
    id: meta.id,
    object: 'chat.completion',
    created: meta.created,
    model: meta.model,
    choices: [
      {
        index: 0,
        message: assistantMessage(reply),
        finish_reason: reply.finish_reason,
        logprobs: null,
      },
    ],
    usage: use,
  };
}

/** Splits text into pieces of about `size` characters that join back to the text exactly. */
export function pieces(text: string, size: number): string[] {
  const out: string[] = [];
  for (let i = 0; i < text.length; i += size) out.push(text.slice(i, i + size));
  return out;
}

const CONTENT_PIECE = /\S+\s*|\s+/g;
const ARGUMENTS_PIECE_CHARS = 8;

/** The deltas of a streamed reply: the role, then content word by word or each tool call in pieces. */
function deltas(reply: AssistantReply): Record<string, unknown>[] {
  if (reply.finish_reason === 'stop') {
    return [
      { role: 'assistant', content: '' },
      ...(reply.content.match(CONTENT_PIECE) ?? []).map((content) => ({ content })),
    ];
  }
  return [
    { role: 'assistant', content: null },
    ...reply.tool_calls.flatMap((call, index) => [
      {
        tool_calls: [
          {
            index,
            id: call.id,
            type: 'function',
            function: { name: call.function.name, arguments: '' },
          },
        ],
      },
      ...pieces(call.function.arguments, ARGUMENTS_PIECE_CHARS).map((args) => ({
        tool_calls: [{ index, function: { arguments: args } }],
      })),
    ]),
  ];
}

/** Every `chat.completion.chunk` of a streamed reply, in order (the `[DONE]` line is not a chunk). */
export function completionChunks(
  meta: CompletionMeta,
  reply: AssistantReply,
  use: Usage,
  includeUsage: boolean,
): object[] {
  const chunk = (choices: object[], extra: object = {}): object => ({
    id: meta.id,
    object: 'chat.completion.chunk',
    created: meta.created,
    model: meta.model,
    choices,
    ...extra,
  });
  const chunks = deltas(reply).map((delta) =>
    chunk([{ index: 0, delta, finish_reason: null, logprobs: null }]),
  );
  chunks.push(chunk([{ index: 0, delta: {}, finish_reason: reply.finish_reason, logprobs: null }]));
  if (includeUsage) chunks.push(chunk([], { usage: use }));
  return chunks;
}

export function modelList(model: string): object {
  return {
    object: 'list',
    data: [{ id: model, object: 'model', created: 0, owned_by: 'ckpt-gym' }],
  };
}
