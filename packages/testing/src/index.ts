/**
 * @ckpt-gym/testing: what the packages' tests share, and what a user testing a server or a
 * participant of their own can take: gates and waits, episode ids, a control client, stub
 * servers, a participant harness on a fake clock, and malformed requests for a route's property
 * test. Every resource is `AsyncDisposable`, so a test writes `await using`.
 */
export {
  type ControlClient,
  type ControlReply,
  controlClient,
  type Json,
} from './control-client.js';
export { type CorruptedCopy, writeCorruptedCopy } from './corrupt.js';
export { ep, episodes } from './episodes.js';
// Core's own doubles: core's tests need them, and core cannot depend on this kit.
export {
  FakeClock,
  Gate,
  type LogLine,
  MemoryLogger,
  settle,
  tcpKeepAliveTimerOn,
} from '@ckpt-gym/core/testing';
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
export {
  type HarnessOptions,
  participantHarness,
  type ParticipantHarness,
} from './participant-harness.js';
export { closeNow, type DisposableServer, serve } from './serve.js';
export {
  AGENT_RESPONSE,
  type Behaviour,
  type Call,
  OBSERVATIONS,
  stubAgent,
  stubResources,
  StubServer,
} from './stubs/http-stub.js';
export {
  type RecordedCall,
  responseWith,
  startStubModel,
  startStubToolResources,
  type StubModel,
  type StubToolResources,
} from './stubs/model.js';
export { type Status, tracked } from './tracked.js';
export { deadline, POLL_MS, until, UNTIL_TIMEOUT_MS, UntilTimeoutError } from './wait.js';
