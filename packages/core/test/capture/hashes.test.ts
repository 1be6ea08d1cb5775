import {
  assistantFingerprint,
  conversationDigest,
  normalizeMessage,
} from '../../src/capture/hashes.js';

/** An assistant turn calling `get_weather`, its arguments given by `fn`. */
function toolTurn(fn: Record<string, unknown>): unknown {
  return {
    role: 'assistant',
    content: null,
    tool_calls: [{ id: 'c1', type: 'function', function: { name: 'get_weather', ...fn } }],
  };
}

describe('conversation digests', () => {
  test("a tool call without arguments (missing or null) normalizes to '' arguments, as NeMo Gym's lineage does", () => {
    for (const fn of [{}, { arguments: null }]) {
      expect(normalizeMessage(toolTurn(fn)).tool_calls).toEqual([
        { name: 'get_weather', arguments: '' },
      ]);
      const messages = [{ role: 'user', content: 'hi' }, toolTurn(fn)];
      // The same digests as a turn whose arguments are the empty string.
      const empty = [{ role: 'user', content: 'hi' }, toolTurn({ arguments: '' })];
      expect([conversationDigest(messages), assistantFingerprint(messages)]).toEqual([
        conversationDigest(empty),
        assistantFingerprint(empty),
      ]);
    }
  });

  test('tool-call arguments: a string as sent, another value as its JSON', () => {
    expect(
      normalizeMessage(toolTurn({ arguments: '{"city": "Paris"}' })).tool_calls[0]?.arguments,
    ).toBe('{"city": "Paris"}');
    expect(
      normalizeMessage(toolTurn({ arguments: { city: 'Paris' } })).tool_calls[0]?.arguments,
    ).toBe('{"city":"Paris"}');
  });
});
