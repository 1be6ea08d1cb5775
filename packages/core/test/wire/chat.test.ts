import { type ChatCompletionRequest, parseChatCompletionRequest } from '../../src/wire/index.js';
import { rootCaptureAdmission } from '../../src/capture/index.js';
import { refusal } from './support.js';

/** A captured call's body as the policy model server sends it to its worker. */
const CHAT: ChatCompletionRequest = {
  model: 'm',
  messages: [{ role: 'user', content: 'hi' }],
  stream: true,
  stream_options: { include_usage: true },
  temperature: 0.5,
  ng_capture: rootCaptureAdmission('r1', 'c1'),
};

describe('the chat-completions contract', () => {
  test('a body the sender built passes unchanged, unread fields included', () => {
    expect(parseChatCompletionRequest(structuredClone(CHAT))).toEqual(CHAT);
  });

  test.each([
    ['a body that is no object', 'hi', 'body: must be a JSON object'],
    ['no messages', { model: 'm' }, 'messages: must be a non-empty array'],
    ['a model that is no string', { ...CHAT, model: 1 }, 'model: must be a string'],
    ['a stream flag that is a string', { ...CHAT, stream: 'yes' }, 'stream: must be a boolean'],
    [
      'stream_options that are a list',
      { ...CHAT, stream_options: [] },
      'stream_options: must be an object',
    ],
    [
      'a message without a role',
      { ...CHAT, messages: [{}] },
      'messages[0]: must be an object with a string role',
    ],
  ])('%s is 422 invalid_request naming the field', (_what, body, detail) => {
    expect(refusal(() => parseChatCompletionRequest(body))).toBe(detail);
  });
});
