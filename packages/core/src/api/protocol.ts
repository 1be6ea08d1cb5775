/**
 * The wire protocol every side shares: the error catalogue (one class per code, each code's retry
 * rule), episode identity and capture keys, the checkpoint headers, the faithful JSON codec, the
 * control requests' schemas and phases, manifest signing, and the bodies servers send each other.
 *
 * @example
 * import { errorFromBody, StaleAttemptError } from '@ckpt-gym/core/protocol';
 * const err = errorFromBody(409, await reply.json());
 * if (err instanceof StaleAttemptError) retireAndRestart();
 *
 * @module
 */
export { type Phase, PHASES } from '../control/phases.js';
export {
  CHECKPOINT_ID_MAX_LENGTH,
  CHECKPOINT_ID_PATTERN,
  type CheckpointRequest,
  type CommitRequest,
  CONTROL_VALIDATORS,
  type ControlRequests,
  type ControlRoute,
  type ForgetRequest,
  type PrepareRequest,
  type RestoreRequest,
  type RetireRequest,
} from '../control/schemas.js';
export {
  ActivationOutOfOrderError,
  AdmissionClosedError,
  CheckpointError,
  CheckpointStateError,
  CkptGymError,
  ConfigError,
  CoordinatorUnavailableError,
  DeadlineExceededError,
  ERROR_CATALOGUE,
  type ErrorBody,
  type ErrorCode,
  errorFromBody,
  InternalError,
  InvalidRequestError,
  InvalidRolloutIdError,
  isErrorCode,
  NotFoundError,
  RetireIncompleteError,
  retryRule,
  type RetryRule,
  RolloutIdRequiredError,
  RolloutRetiredError,
  StaleAttemptError,
  toClientError,
  UnauthorizedError,
  UpstreamError,
} from '../errors.js';
export {
  AGENT_ACTIVATION_HEADER,
  CHECKPOINT_CLOSE_FOLLOWS_HEADER,
  CHECKPOINT_RESTART_HEADER,
  CHECKPOINT_VERIFY_HEADER,
} from '../headers.js';
export {
  captureKey,
  covers,
  episodeFromRunBody,
  episodeId,
  type EpisodeId,
  episodeIdFromJson,
  episodeIdToJson,
  isCaptureKey,
  MAX_ATTEMPT,
  MAX_CAPTURE_KEY_LENGTH,
  MAX_ROLLOUT_ID_LENGTH,
  nextAttempt,
  parseCaptureKey,
  requestEpisode,
  ROLLOUT_ID_PATTERN,
  rolloutPrefixMiddleware,
  sameEpisode,
  withRolloutPrefix,
} from '../identity.js';
export { decodeJson, encodeJson, type JsonObject, type JsonValue } from '../json.js';
export { signed, verifyManifestMac } from '../signing.js';
export {
  activationHeader,
  type AgentCloseRequest,
  type AgentSeedRequest,
  type CloseReceipt,
  type DirectHttpGrant,
  type DirectHttpToolAccess,
  type McpGrant,
  type McpToolAccess,
  parseActivationHeader,
  parseAgentCloseRequest,
  parseAgentSeedRequest,
  parseDirectHttpGrant,
  parseMcpGrant,
  type ToolAccess,
} from '../wire/agent-sessions.js';
export { type ChatCompletionRequest, parseChatCompletionRequest } from '../wire/chat.js';
export {
  isNativeBody,
  type NativeCloseRequest,
  type NativeSeedReply,
  type NativeSeedRequest,
  parseNativeCloseRequest,
  parseNativeSeedRequest,
  type ResourcesTaskId,
  type ResourcesTools,
} from '../wire/resources-sessions.js';
export {
  type AggregateMetricsRequest,
  type EpisodeRequest,
  type LegacyRunRow,
  parseAggregateMetricsRequest,
  parseEpisodeRequest,
  parseLegacyRunRow,
  type Task,
  type TaskId,
} from '../wire/run.js';
export { MAX_SESSION_ID_CHARS } from '../wire/validate.js';
