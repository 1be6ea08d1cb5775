import { InvalidRequestError, episodeId } from '@ckpt-gym/core/protocol';

import {
  type ChatMessage,
  SCRIPTS,
  ScriptBook,
  parseScript,
  scriptedReply,
  toolTurnAt,
} from '../src/script.js';

const user: ChatMessage = { role: 'user', content: 'What is the weather in SF?' };
const toolResult = (content: string): ChatMessage => ({ role: 'tool', tool_call_id: 'x', content });
const assistantCall: ChatMessage = { role: 'assistant', content: null, tool_calls: [] };

describe('the turn is decided by the conversation', () => {
  test('weather: a fresh conversation gets the get_weather tool call', () => {
    const reply = scriptedReply(SCRIPTS.weather, [user], 0);
    expect(reply).toEqual({
      content: null,
      tool_calls: [
        {
          id: 'call_0_0',
          type: 'function',
          function: { name: 'get_weather', arguments: '{"city":"SF"}' },
        },
      ],
      finish_reason: 'tool_calls',
    });
  });

  test('weather: after the tool result comes the final answer, whatever call number this is', () => {
    const reply = scriptedReply(SCRIPTS.weather, [user, assistantCall, toolResult('sunny')], 7);
    expect(reply).toEqual({ content: 'The weather in SF is sunny.', finish_reason: 'stop' });
  });

  test('counter: count 1, then count 2, then the final answer', () => {
    const args = (messages: ChatMessage[]) => {
      const reply = scriptedReply(SCRIPTS.counter, messages, 0);
      return reply.finish_reason === 'tool_calls'
        ? reply.tool_calls[0]?.function.arguments
        : reply.content;
    };
    const one = [user, assistantCall, toolResult('4')];
    expect(args([user])).toBe('{"count":1}');
    expect(args(one)).toBe('{"count":2}');
    expect(args([...one, assistantCall, toolResult('6')])).toBe(SCRIPTS.counter.final_answer);
  });

  test('assistant messages without tool results do not advance the script', () => {
    const reply = scriptedReply(
      SCRIPTS.counter,
      [user, { role: 'assistant', content: 'thinking' }],
      0,
    );
    expect(reply.finish_reason).toBe('tool_calls');
  });

  test('a client that keeps calling after the final answer gets the final answer again', () => {
    expect(toolTurnAt(SCRIPTS.weather, 5)).toBeUndefined();
  });

  test('a turn with parallel tool calls waits for all of their results', () => {
    const script = parseScript([
      {
        tool_calls: [
          { name: 'a', arguments: {} },
          { name: 'b', arguments: {} },
        ],
      },
      { tool_calls: [{ name: 'c', arguments: {} }] },
      { content: 'done' },
    ]);
    expect(toolTurnAt(script, 1)?.map((c) => c.name)).toEqual(['a', 'b']);
    expect(toolTurnAt(script, 2)?.map((c) => c.name)).toEqual(['c']);
    const reply = scriptedReply(script, [user], 3);
    expect(reply.finish_reason === 'tool_calls' && reply.tool_calls.map((c) => c.id)).toEqual([
      'call_3_0',
      'call_3_1',
    ]);
  });
});

describe('parseScript', () => {
  test('built-in names', () => {
    expect(parseScript('weather')).toBe(SCRIPTS.weather);
    expect(parseScript('counter')).toBe(SCRIPTS.counter);
  });

  test('a turns list becomes tool turns and a final answer', () => {
    expect(
      parseScript([{ tool_calls: [{ name: 'f', arguments: { x: 1 } }] }, { content: 'ok' }]),
    ).toEqual({
      tool_turns: [[{ name: 'f', arguments: { x: 1 } }]],
      final_answer: 'ok',
    });
  });

  test.each([
    ['an unknown name', 'sunny'],
    ['an empty list', []],
    ['a number', 3],
    ['no final answer', [{ tool_calls: [{ name: 'f', arguments: {} }] }]],
    ['a final answer before the end', [{ content: 'early' }, { content: 'late' }]],
    ['an empty tool_calls', [{ tool_calls: [] }, { content: 'x' }]],
    ['a nameless tool call', [{ tool_calls: [{ name: '', arguments: {} }] }, { content: 'x' }]],
    ['string arguments', [{ tool_calls: [{ name: 'f', arguments: '{}' }] }, { content: 'x' }]],
    [
      'an unknown tool call key',
      [{ tool_calls: [{ name: 'f', arguments: {}, id: 'c' }] }, { content: 'x' }],
    ],
    ['a non-string final answer', [{ content: 1 }]],
  ])('refuses %s', (_what, value) => {
    expect(() => parseScript(value)).toThrow(InvalidRequestError);
  });
});

describe('ScriptBook', () => {
  test('exact capture key, then rollout id (every attempt), then the default', () => {
    const book = new ScriptBook();
    book.setFor('c', SCRIPTS.counter);
    const custom = parseScript([{ content: 'only attempt 2' }]);
    book.setFor('c-a2', custom);
    expect(book.scriptFor(undefined)).toBe(SCRIPTS.weather);
    expect(book.scriptFor(episodeId('other'))).toBe(SCRIPTS.weather);
    expect(book.scriptFor(episodeId('c'))).toBe(SCRIPTS.counter);
    expect(book.scriptFor(episodeId('c', 1))).toBe(SCRIPTS.counter);
    expect(book.scriptFor(episodeId('c', 2))).toBe(custom);
  });

  test('setDefault changes the script of rollouts without an override', () => {
    const book = new ScriptBook();
    book.setDefault(SCRIPTS.counter);
    expect(book.scriptFor(episodeId('r'))).toBe(SCRIPTS.counter);
  });

  test('a malformed rollout key is invalid_request', () => {
    expect(() => new ScriptBook().setFor('x-a1-a2', SCRIPTS.counter)).toThrow(InvalidRequestError);
  });
});
