import { episodeId } from '@ckpt-gym/core/protocol';

import {
  CallLog,
  TokenStore,
  completionTokens,
  messageText,
  promptTokens,
  tokenize,
} from '../src/calls.js';
import { SCRIPTS, scriptedReply } from '../src/script.js';

describe('deterministic tokens', () => {
  test('the same text gives the same ids, one per word or punctuation mark', () => {
    const ids = tokenize('The weather, in SF.');
    expect(ids).toHaveLength(6);
    expect(tokenize('The weather, in SF.')).toEqual(ids);
    expect(ids.every((id) => Number.isInteger(id) && id >= 1 && id < 32_000)).toBe(true);
    expect(tokenize('The')[0]).toBe(ids[0]);
    expect(tokenize('the')[0]).not.toBe(ids[0]);
  });

  test('a message contributes its role, text parts and tool calls', () => {
    expect(
      messageText({ role: 'user', content: [{ type: 'text', text: 'hi' }, { type: 'image_url' }] }),
    ).toBe('user hi ');
    expect(
      messageText({
        role: 'assistant',
        content: null,
        tool_calls: [{ function: { name: 'get_weather', arguments: '{"city":"SF"}' } }],
      }),
    ).toBe('assistant  get_weather {"city":"SF"}');
  });

  test('prompt tokens grow with the conversation; completion tokens come from the reply', () => {
    const short = promptTokens([{ role: 'user', content: 'a b' }]);
    const long = promptTokens([
      { role: 'user', content: 'a b' },
      { role: 'tool', content: 'sunny' },
    ]);
    expect(long.slice(0, short.length)).toEqual(short);
    expect(long.length).toBeGreaterThan(short.length);
    const final = scriptedReply(SCRIPTS.weather, [{ role: 'tool', content: 'x' }], 0);
    expect(completionTokens(final)).toEqual(tokenize(SCRIPTS.weather.final_answer));
  });
});

describe('TokenStore', () => {
  test('keeps token ids per call', () => {
    const store = new TokenStore();
    store.put(3, { prompt_token_ids: [1, 2], completion_token_ids: [3] });
    expect(store.get(3)).toEqual({ prompt_token_ids: [1, 2], completion_token_ids: [3] });
    expect(store.get(4)).toBeUndefined();
  });

  test('cut rounds start empty, are recorded in order and are returned as copies', () => {
    const store = new TokenStore();
    expect(store.cutRounds()).toEqual([]);
    store.recordCutRound(['m1', 'm2']);
    store.recordCutRound([]);
    const rounds = store.cutRounds();
    expect(rounds).toEqual([['m1', 'm2'], []]);
    rounds[0]?.push('tampered');
    expect(store.cutRounds()[0]).toEqual(['m1', 'm2']);
  });
});

describe('CallLog', () => {
  const call = (rollout?: string, attempt = 0) => ({
    episode: rollout === undefined ? undefined : episodeId(rollout, attempt),
    n_messages: 2,
    admission: null,
    stream: false,
  });

  test('global indexes in arrival order, identity from the episode, untagged calls are null', () => {
    const log = new CallLog(new TokenStore());
    const a = log.admit(call('r', 2));
    const b = log.admit(call());
    expect(a.record).toMatchObject({ index: 0, capture_key: 'r-a2', rollout_id: 'r', attempt: 2 });
    expect(b.record).toMatchObject({
      index: 1,
      capture_key: null,
      rollout_id: null,
      attempt: null,
    });
    expect(b.rolloutCallIndex).toBeNull();
    expect(log.count).toBe(2);
  });

  test("a rollout's calls are counted over all its attempts", () => {
    const log = new CallLog(new TokenStore());
    expect(log.admit(call('r')).rolloutCallIndex).toBe(0);
    expect(log.admit(call('s')).rolloutCallIndex).toBe(0);
    expect(log.admit(call('r')).rolloutCallIndex).toBe(1);
    expect(log.admit(call('r', 1)).rolloutCallIndex).toBe(2);
  });

  test('the list shows token counts from the store', () => {
    const tokens = new TokenStore();
    const log = new CallLog(tokens);
    const { record } = log.admit(call('r'));
    tokens.put(record.index, { prompt_token_ids: [1, 2, 3], completion_token_ids: [4] });
    expect(log.list()[0]).toMatchObject({
      prompt_tokens: 3,
      completion_tokens: 1,
      returned: false,
      held: false,
    });
  });
});
