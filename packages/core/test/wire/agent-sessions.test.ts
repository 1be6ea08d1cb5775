import { ActivationOutOfOrderError, InvalidRequestError } from '../../src/errors.js';
import { AGENT_ACTIVATION_HEADER } from '../../src/headers.js';
import {
  activationHeader,
  type AgentCloseRequest,
  type AgentSeedRequest,
  type DirectHttpGrant,
  parseActivationHeader,
  parseAgentCloseRequest,
  parseAgentSeedRequest,
  parseDirectHttpGrant,
  MAX_SESSION_ID_CHARS,
} from '../../src/wire/index.js';
import { refusal } from './support.js';

const GRANT: DirectHttpGrant = {
  kind: 'direct_http',
  name: 'weather.direct_http',
  required: true,
  base_url: 'http://127.0.0.1:1/ng-rollout/r1',
  cookies: { session: 'abc' },
};

/** A seed as the environment server builds it. */
const SEED: AgentSeedRequest = {
  agent_session_id: 'agent-session-1',
  episode_id: { rollout_id: 'r1', attempt: 2 },
  task_id: { taskset: 'weather', task_id: 't1' },
  tool_accesses: [GRANT],
  sandbox_access: null,
};

describe('the agent seed contract', () => {
  test('a seed the sender built passes unchanged', () => {
    expect(parseAgentSeedRequest(structuredClone(SEED))).toEqual(SEED);
  });

  test('the optional fields default: no task id, no tool accesses, no sandbox, attempt 0', () => {
    expect(
      parseAgentSeedRequest({ agent_session_id: 's', episode_id: { rollout_id: 'r1' } }),
    ).toEqual({
      agent_session_id: 's',
      episode_id: { rollout_id: 'r1', attempt: 0 },
      task_id: null,
      tool_accesses: [],
      sandbox_access: null,
    });
  });

  test('null tool accesses, task id and sandbox read as absent ones', () => {
    const seed = { ...SEED, task_id: null, tool_accesses: null, sandbox_access: null };
    expect(parseAgentSeedRequest(seed)).toEqual({ ...SEED, task_id: null, tool_accesses: [] });
  });

  test('the parsed seed has one key order, whatever order the body had', () => {
    const reordered = Object.fromEntries(Object.entries(SEED).reverse());
    expect(Object.keys(parseAgentSeedRequest(reordered))).toEqual(Object.keys(SEED));
  });

  test.each([
    ['agent_session_id', 'agent_session_id: must be a non-empty string'],
    ['episode_id', 'episode_id: must be an object with rollout_id and attempt'],
  ])('a seed without %s is refused naming it', (field, detail) => {
    const { [field as keyof AgentSeedRequest]: _gone, ...rest } = SEED;
    expect(refusal(() => parseAgentSeedRequest(rest))).toContain(detail);
  });

  test.each([
    ['a body that is no object', [SEED], 'body: must be a JSON object'],
    ['an unknown field', { ...SEED, surprise: 1, more: 2 }, 'body: unknown keys surprise, more'],
    [
      'an agent_session_id that is no string',
      { ...SEED, agent_session_id: 7 },
      'agent_session_id:',
    ],
    ['an empty agent_session_id', { ...SEED, agent_session_id: '' }, 'agent_session_id:'],
    [
      'a lone surrogate in agent_session_id',
      { ...SEED, agent_session_id: '\ud800' },
      'agent_session_id:',
    ],
    [
      'an agent_session_id too long for its cookie',
      { ...SEED, agent_session_id: 'x'.repeat(MAX_SESSION_ID_CHARS + 1) },
      'agent_session_id:',
    ],
    [
      'an episode_id that is a string',
      { ...SEED, episode_id: 'r1' },
      'episode_id: must be an object',
    ],
    [
      'an episode_id with a reserved suffix',
      { ...SEED, episode_id: { rollout_id: 'r1-a2' } },
      'episode_id: rollout_id "r1-a2" must not end with the reserved attempt suffix',
    ],
    [
      'tool_accesses that are no list',
      { ...SEED, tool_accesses: {} },
      'tool_accesses: must be a list',
    ],
    ['a tool access that is no object', { ...SEED, tool_accesses: ['x'] }, 'tool_accesses[0]:'],
    [
      'a tool access without a name',
      { ...SEED, tool_accesses: [GRANT, { kind: 'mcp' }] },
      'tool_accesses[1].name: needs string kind and name',
    ],
    [
      'a tool access whose kind is no string',
      { ...SEED, tool_accesses: [{ ...GRANT, kind: 1 }] },
      'tool_accesses[0].kind: needs string kind and name',
    ],
    [
      'two tool accesses of one name',
      { ...SEED, tool_accesses: [GRANT, GRANT] },
      'tool_accesses[1]: name weather.direct_http is not unique',
    ],
    [
      'a sandbox_access that is a string',
      { ...SEED, sandbox_access: 'box' },
      'sandbox_access: must be an object or null',
    ],
  ])('%s is 422 invalid_request naming the field', (_what, body, detail) => {
    expect(refusal(() => parseAgentSeedRequest(body))).toContain(detail);
  });
});

describe('the direct HTTP grant', () => {
  test('a grant the sender built reads with its defaults filled in', () => {
    expect(parseDirectHttpGrant(GRANT)).toEqual({ ...GRANT, headers: {} });
    expect(parseDirectHttpGrant({ kind: 'direct_http', name: 'n', base_url: 'https://a' })).toEqual(
      {
        kind: 'direct_http',
        name: 'n',
        required: false,
        base_url: 'https://a',
        cookies: {},
        headers: {},
      },
    );
  });

  test.each([
    ['no base_url', { base_url: undefined }, 'base_url: must be an http(s) URL'],
    ['a base_url that is no URL', { base_url: 'http://a b' }, 'base_url: must be an http(s) URL'],
    ['a base_url of another scheme', { base_url: 'ftp://a' }, 'base_url: must be an http(s) URL'],
    ['a cookie value no header can carry', { cookies: { s: 'caf\u20ac' } }, 'cookies.s: must map'],
    ['a cookie value with a semicolon', { cookies: { s: 'a; b=c' } }, 'cookies.s: must map'],
    ['cookies that are a list', { cookies: ['s'] }, 'cookies: must map'],
    ['a header name that is no token', { headers: { 'x y': '1' } }, 'headers: must map'],
    ['a header value with a newline', { headers: { 'x-a': 'a\nb' } }, 'headers.x-a: must map'],
    ['a header value that is a number', { headers: { 'x-a': 1 } }, 'must map'],
  ])('%s is 422 invalid_request naming the grant and the field', (_what, change, detail) => {
    const grant = JSON.parse(JSON.stringify({ ...GRANT, ...change })) as typeof GRANT;
    const message = refusal(() => parseDirectHttpGrant(grant));
    expect(message).toContain('tool access "weather.direct_http"');
    expect(message).toContain(detail);
  });
});

describe('the agent close contract', () => {
  const CLOSE: AgentCloseRequest = {
    agent_session_id: 'agent-session-1',
    episode_id: { rollout_id: 'r1', attempt: 0 },
  };

  test('a close the sender built passes; its episode is optional', () => {
    expect(parseAgentCloseRequest(structuredClone(CLOSE))).toEqual(CLOSE);
    expect(parseAgentCloseRequest({ agent_session_id: 's' })).toEqual({ agent_session_id: 's' });
  });

  test.each([
    ['a body that is no object', 'close', 'body: must be a JSON object'],
    ['a close without agent_session_id', { episode_id: CLOSE.episode_id }, 'agent_session_id:'],
    ['an agent_session_id that is no string', { agent_session_id: ['s'] }, 'agent_session_id:'],
    [
      'an episode_id with an unknown key',
      { ...CLOSE, episode_id: { rollout_id: 'r1', x: 1 } },
      'episode_id: unknown keys x',
    ],
  ])('%s is 422 invalid_request naming the field', (_what, body, detail) => {
    expect(refusal(() => parseAgentCloseRequest(body))).toContain(detail);
  });
});

describe('the activation header', () => {
  test('the header a sender builds reads back as its index; no header is no index', () => {
    expect(activationHeader(3)).toEqual({ [AGENT_ACTIVATION_HEADER]: '3' });
    expect(parseActivationHeader(activationHeader(3)[AGENT_ACTIVATION_HEADER])).toBe(3);
    expect(parseActivationHeader(undefined)).toBeNull();
  });

  test.each(['0', '-1', '1.5', 'one', '99999999999999999999'])(
    '%j is activation_out_of_order, not invalid_request',
    (value) => {
      expect(() => parseActivationHeader(value)).toThrow(ActivationOutOfOrderError);
      expect(() => parseActivationHeader(value)).not.toThrow(InvalidRequestError);
    },
  );
});
