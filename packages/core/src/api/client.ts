/**
 * The client side: HTTP clients with a data pool and a reserved control pool (servers use them for
 * their upstream calls too), the control calls, and the controller's coordination of a checkpoint
 * across participants (discover, prepare, commit, restore, resume, retire, forget, renew).
 *
 * @example
 * import { createHttpClients, createParticipants, prepare, commit, resume } from '@ckpt-gym/core/client';
 *
 * @module
 */
export {
  type CheckedRestore,
  CHECKPOINT_ROUTE_PREFIX,
  checkRestore,
  commit,
  type ControlReply,
  CoordinationError,
  type CoordinationLogger,
  createParticipants,
  discover,
  DISCOVER_TIMEOUT_SECONDS,
  type DiscoverOptions,
  type DiscoverTarget,
  type ExpectedCheckpoint,
  forget,
  type ParticipantMember,
  type Participants,
  prepare,
  PrepareResult,
  renew,
  type Replies,
  replyTimeoutMs,
  restore,
  type RestoreCheckOptions,
  resume,
  retire,
} from '../coordination.js';
export {
  type ControlCallOptions,
  ControlHttpError,
  createHttpClients,
  getControl,
  type HttpClientLimits,
  type HttpClients,
  logTimedOutCall,
  pooledHttpAgent,
  pooledHttpsAgent,
  postUpstream,
  TCP_KEEP_ALIVE_INITIAL_DELAY_MS,
  withoutSecrets,
} from '../http-client.js';
export { REQUEST_ID_HEADER, requestIdHeaders } from '../telemetry/request-id.js';
export {
  ATTR_SERVICE_INSTANCE_ID,
  DEFAULT_TRACES_ENDPOINT,
  inSpan,
  startTracing,
  startTracingFor,
  type StartTracingOptions,
  stopTracing,
  type Tracing,
  tracingOn,
  tracingPlan,
  type TracingPlan,
  TRACER_NAME,
} from '../telemetry/tracing.js';
export { withTraceContext } from '../telemetry/request-spans.js';
