import { describe, expect, it } from '@jest/globals';

import {
  chatToResponse,
  inputToMessages,
  ResponsesStream,
  responsesToChatRequest,
} from '../src/index.js';

describe('Responses → chat request', () => {
  it('turns instructions, messages, function calls and their outputs into chat messages', () => {
    const messages = inputToMessages(
      [
        { role: 'developer', content: 'be brief' },
        { type: 'message', role: 'user', content: [{ type: 'input_text', text: 'hi' }] },
        { type: 'reasoning', summary: [{ type: 'summary_text', text: 'think' }] },
        { type: 'function_call', call_id: 'c1', name: 'f', arguments: '{"a":1}' },
        { type: 'function_call', call_id: 'c2', name: 'g', arguments: '{}' },
        { type: 'function_call_output', call_id: 'c1', output: 'one' },
        {
          type: 'function_call_output',
          call_id: 'c2',
          output: [{ type: 'input_text', text: 'two' }],
        },
        { role: 'assistant', content: [{ type: 'output_text', text: 'done' }] },
      ],
      'sys',
    );
    expect(messages).toEqual([
      { role: 'system', content: 'sys' },
      { role: 'system', content: 'be brief' },
      { role: 'user', content: 'hi' },
      {
        role: 'assistant',
        content: null,
        reasoning_content: 'think',
        tool_calls: [
          { id: 'c1', type: 'function', function: { name: 'f', arguments: '{"a":1}' } },
          { id: 'c2', type: 'function', function: { name: 'g', arguments: '{}' } },
        ],
      },
      { role: 'tool', tool_call_id: 'c1', content: 'one' },
      { role: 'tool', tool_call_id: 'c2', content: 'two' },
      { role: 'assistant', content: 'done' },
    ]);
  });

  it('maps function tools, tool_choice, limits, reasoning effort and streaming', () => {
    const chat = responsesToChatRequest({
      model: 'm',
      input: 'q',
      tools: [{ type: 'function', name: 'f', parameters: { type: 'object' }, strict: true }],
      tool_choice: { type: 'function', name: 'f' },
      max_output_tokens: 7,
      reasoning: { effort: 'low' },
      stream: true,
    });
    expect(chat).toEqual({
      model: 'm',
      messages: [{ role: 'user', content: 'q' }],
      tools: [
        { type: 'function', function: { name: 'f', parameters: { type: 'object' }, strict: true } },
      ],
      tool_choice: { type: 'function', function: { name: 'f' } },
      max_tokens: 7,
      reasoning_effort: 'low',
      stream: true,
      stream_options: { include_usage: true },
    });
  });

  it('refuses what it cannot convert with 422 invalid_request', () => {
    expect(() => responsesToChatRequest({ input: 5 })).toThrow(
      expect.objectContaining({ code: 'invalid_request' }),
    );
    expect(() => responsesToChatRequest({ input: 'q', tools: [{ type: 'web_search' }] })).toThrow(
      expect.objectContaining({ code: 'invalid_request' }),
    );
    expect(() => inputToMessages([{ type: 'function_call', name: 'f', arguments: '{}' }])).toThrow(
      expect.objectContaining({ code: 'invalid_request' }),
    );
  });
});

describe('chat answer → Response', () => {
  it('passes reasoning through and turns tool calls into function_call items', () => {
    const response = chatToResponse(
      { model: 'm' },
      {
        id: 'chatcmpl-1',
        created: 5,
        model: 'm',
        choices: [
          {
            finish_reason: 'tool_calls',
            message: {
              role: 'assistant',
              content: 'let me check',
              reasoning_content: 'need weather',
              tool_calls: [
                { id: 'c1', type: 'function', function: { name: 'f', arguments: '{}' } },
              ],
            },
          },
        ],
        usage: { prompt_tokens: 3, completion_tokens: 4, total_tokens: 7 },
      },
    );
    expect(response).toMatchObject({
      id: 'resp_chatcmpl-1',
      object: 'response',
      status: 'completed',
      output: [
        { type: 'reasoning', content: [{ type: 'reasoning_text', text: 'need weather' }] },
        { type: 'message', content: [{ type: 'output_text', text: 'let me check' }] },
        { type: 'function_call', call_id: 'c1', name: 'f', arguments: '{}' },
      ],
      usage: { input_tokens: 3, output_tokens: 4, total_tokens: 7 },
    });
  });

  it('marks an answer cut by the length limit incomplete', () => {
    const response = chatToResponse(
      {},
      { id: 'x', choices: [{ finish_reason: 'length', message: { content: 'a' } }] },
    );
    expect(response).toMatchObject({
      status: 'incomplete',
      incomplete_details: { reason: 'max_output_tokens' },
    });
  });

  it('streams reasoning, text and a tool call as numbered Responses events', () => {
    const stream = new ResponsesStream({ model: 'm' });
    const events = [
      ...stream.chunk({ id: 'c', choices: [{ delta: { reasoning_content: 'hm' } }] }),
      ...stream.chunk({ id: 'c', choices: [{ delta: { content: 'ok' } }] }),
      ...stream.chunk({
        id: 'c',
        choices: [
          {
            delta: {
              tool_calls: [{ index: 0, id: 't', function: { name: 'f', arguments: '{"a"' } }],
            },
          },
        ],
      }),
      ...stream.chunk({
        id: 'c',
        choices: [
          {
            delta: { tool_calls: [{ index: 0, function: { arguments: ':1}' } }] },
            finish_reason: 'tool_calls',
          },
        ],
      }),
      ...stream.finish(),
    ];
    expect(events.map((e) => e.sequence_number)).toEqual(events.map((_, i) => i));
    expect(events.map((e) => e.type)).toEqual([
      'response.created',
      'response.in_progress',
      'response.output_item.added',
      'response.content_part.added',
      'response.reasoning_text.delta',
      'response.reasoning_text.done',
      'response.content_part.done',
      'response.output_item.done',
      'response.output_item.added',
      'response.content_part.added',
      'response.output_text.delta',
      'response.output_text.done',
      'response.content_part.done',
      'response.output_item.done',
      'response.output_item.added',
      'response.function_call_arguments.delta',
      'response.function_call_arguments.delta',
      'response.function_call_arguments.done',
      'response.output_item.done',
      'response.completed',
    ]);
    expect(events.at(-1)).toMatchObject({
      response: {
        id: 'resp_c',
        output: [
          { type: 'reasoning' },
          { type: 'message', content: [{ text: 'ok' }] },
          { type: 'function_call', call_id: 't', arguments: '{"a":1}' },
        ],
      },
    });
  });
});
