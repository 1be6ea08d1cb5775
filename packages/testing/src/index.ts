/**
 * @ckpt-gym/testing: what the packages' tests share, and what a user testing a server of their own
 * can take. Today: malformed requests for a route's property test, and the check that a server
 * answered each as a client's mistake (below 500, in the standard JSON error shape).
 */
export {
  closeConnections,
  expectClientOutcome,
  fuzzParameters,
  jsonRequest,
  malformedRequest,
  type RawReply,
  type RawRequest,
  replyProblem,
  send,
} from './malformed.js';
