import { InvalidRequestError } from '../src/errors.js';
import { checkChatMessages } from '../src/openai.js';

describe('checkChatMessages', () => {
  const withCalls = (calls: unknown) => [{ role: 'assistant', tool_calls: calls }];

  test('absent, null, empty and well-formed tool calls pass', () => {
    for (const calls of [undefined, null, [], [{ function: { name: 'f', arguments: '{}' } }]]) {
      expect(() => checkChatMessages(withCalls(calls))).not.toThrow();
    }
  });

  test.each([
    ['not a list', { function: {} }, 'messages[0].tool_calls: must be a list'],
    [
      'a call that is no object',
      ['f'],
      'messages[0].tool_calls[0].function: must be an object with string name and arguments',
    ],
    [
      'no function',
      [{}],
      'messages[0].tool_calls[0].function: must be an object with string name and arguments',
    ],
    [
      'a name that is no string',
      [{ function: { name: { toString: 1 }, arguments: '' } }],
      'messages[0].tool_calls[0].function: must be an object with string name and arguments',
    ],
    [
      'arguments that are no string',
      [{ function: { name: 'f', arguments: {} } }],
      'messages[0].tool_calls[0].function: must be an object with string name and arguments',
    ],
    [
      'missing arguments, second call',
      [{ function: { name: 'f', arguments: '' } }, { function: { name: 'g' } }],
      'messages[0].tool_calls[1].function: must be an object with string name and arguments',
    ],
  ])('%s is 422 invalid_request naming the path', (_what, calls, detail) => {
    let thrown: unknown;
    try {
      checkChatMessages(withCalls(calls));
    } catch (err) {
      thrown = err;
    }
    expect(thrown).toBeInstanceOf(InvalidRequestError);
    expect([
      (thrown as InvalidRequestError).status,
      (thrown as InvalidRequestError).detail,
    ]).toEqual([422, detail]);
  });
});

test.each([
  ['no messages', undefined, 'messages: must be a non-empty array'],
  ['an empty list', [], 'messages: must be a non-empty array'],
  ['a message that is no object', ['hi'], 'messages[0]: must be an object with a string role'],
  ['a role that is no string', [{ role: 1 }], 'messages[0]: must be an object with a string role'],
])('checkChatMessages: %s is 422 invalid_request', (_what, messages, detail) => {
  expect(() => checkChatMessages(messages)).toThrow(new InvalidRequestError(detail));
});
