import fc from 'fast-check';

import { jsonRequest, malformedRequest, type RawReply, replyProblem } from '../src/index.js';

function reply(
  status: number,
  body: unknown,
  contentType = 'application/json; charset=utf-8',
): RawReply {
  return {
    status,
    contentType,
    text: typeof body === 'string' ? body : JSON.stringify(body),
    cookies: [],
  };
}

describe('replyProblem: a reply is a client error or success in the standard shape', () => {
  test('a success, and a 4xx carrying its catalogue code, pass', () => {
    expect(replyProblem(reply(200, { ok: true }))).toBeUndefined();
    expect(
      replyProblem(reply(422, { error: { code: 'invalid_request', detail: 'body: bad' } })),
    ).toBeUndefined();
  });

  test.each([
    [
      'a 5xx, even in the standard shape',
      reply(500, { error: { code: 'internal_error', detail: 'x' } }),
      'a 500',
    ],
    ['an HTML page', reply(404, '<html>no</html>', 'text/html'), 'content-type text/html'],
    ['a body that is not JSON', reply(400, 'nope'), 'a body that is not JSON'],
    [
      'a code the catalogue lacks',
      reply(400, { error: { code: 'oops', detail: 'x' } }),
      'error code "oops" is not in the catalogue',
    ],
    [
      'no string detail',
      reply(422, { error: { code: 'invalid_request' } }),
      'no string error.detail',
    ],
    [
      "a status not the code's own",
      reply(400, { error: { code: 'invalid_request', detail: 'x' } }),
      "status 400 is not invalid_request's 422",
    ],
  ])('%s is a problem', (_what, answer, problem) => {
    expect(replyProblem(answer)).toBe(problem);
  });
});

describe('malformedRequest', () => {
  test('every case is another request than the valid one it starts from, and says what it broke', () => {
    const valid = { input: [{ role: 'user', content: 'hi' }], temperature: 0.5 };
    const validRequest = jsonRequest(valid);
    fc.assert(
      fc.property(malformedRequest(valid), (raw) => {
        expect(raw.what).not.toBe(validRequest.what);
        const same =
          raw.contentType === validRequest.contentType && raw.body.equals(validRequest.body);
        expect(same).toBe(false);
      }),
      { numRuns: 500 },
    );
  });
});
