import { InvalidRequestError } from '../../src/errors.js';

/** The detail of the 422 `invalid_request` that `fn` throws; fails the test if it throws nothing else. */
export function refusal(fn: () => unknown): string {
  try {
    fn();
  } catch (err) {
    expect(err).toBeInstanceOf(InvalidRequestError);
    expect(err).toMatchObject({ code: 'invalid_request', status: 422 });
    return (err as Error).message;
  }
  throw new Error('expected a refusal');
}
