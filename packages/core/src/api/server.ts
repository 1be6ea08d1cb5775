/**
 * What a gym server is built from: the stack-file settings, logging, the participant contract and
 * its control plane, the request lifecycle and admission gate, episode steps, the record store, and
 * `createGymApp` / `listen`.
 *
 * @example
 * import { createGymApp, listen, loadStackFile } from '@ckpt-gym/core/server';
 * const stack = loadStackFile('stack.yaml');
 * const gym = createGymApp({ name: 'my-tools', kind: 'resources', checkpoint: stack.checkpoint, participant });
 * await listen(gym.finish(), 8101, '127.0.0.1');
 *
 * @module
 */
export {
  AdmissionGate,
  type AdmissionGateOptions,
  type AdmissionTicket,
  type AdmitOptions,
  type EnterOptions,
  type GateRule,
  type GateSnapshot,
  type GateView,
} from '../admission/gate.js';
export {
  agentCloseAdmission,
  agentSeedAdmission,
  type AttemptState,
  type Decision,
  episodeRunAdmission,
  type EpisodeRunState,
  isReplayableVerify,
  legacyRunAdmission,
  type LegacyRunState,
  modelCallAdmission,
  type ModelCallState,
  type OpenState,
  resourcesAdmission,
  type ResourcesMode,
  type ResourcesRequestState,
  type ResourcesRole,
  type ResourcesVerify,
  type ResourcesWaitState,
  restartCallAdmission,
  staleCall,
} from '../admission/rules.js';
export { type ControlClock, forEachBounded } from '../control/deadline.js';
export {
  type ControlObserver,
  type ObservedOperation,
  type OperationEvent,
  type RefusalEvent,
  type StageName,
  type StageTiming,
} from '../control/observer.js';
export { type LastCheckpoint, type LastOperation } from '../control/last-checkpoint.js';
export { ControlPlane, type ControlPlaneOptions } from '../control/plane.js';
export {
  type CommitReply,
  type PrepareReply,
  type RestoreReply,
  type ResumeReply,
  type StatusReply,
} from '../control/replies.js';
export {
  bearerAuth,
  type ControlRouterOptions,
  type ControlTarget,
  installControlPlane,
  planeTarget,
} from '../control/routes.js';
export { type ControlStorage, type ParticipantStorageOptions } from '../control/storage.js';
export { type ErrorLogger, errorMiddleware, jsonBody, notFoundMiddleware } from '../express.js';
export { fsyncDirectory } from '../fsync.js';
export { ENCODE_AHEAD_SETTLE_MS, IdleQueue, type IdleQueueOptions } from '../idle-queue.js';
export { createLogger, type Logger, type LoggerContext, type LogMeta } from '../logging.js';
export { checkChatMessages } from '../openai.js';
export {
  type AdmissionRequest,
  BaseParticipant,
  type Participant,
  type ParticipantKind,
  PREPARE_ORDER,
  prepareReport,
  type PrepareReport,
  RetiredMarks,
} from '../participant.js';
export {
  type BodyRule,
  type EpisodeRule,
  gymRoute,
  type GymRoute,
  type GymRouteDeclaration,
  mountRoutes,
  type RequestContext,
} from '../route.js';
export {
  type FromStackOptions,
  type GymServer,
  type GymServerParts,
  kindSchemas,
  listenGymServer,
  listeningLine,
  runServerMain,
  runServerProcess,
  type RunningServer,
  type ServerKindModule,
  serverOfKind,
  startServer,
  startServerMain,
  type WorkerContext,
  type WorkersSupport,
} from '../server-kind.js';
export {
  answerParserErrorsAsJson,
  type ConnectionLimits,
  createGymApp,
  type GymApp,
  type GymAppOptions,
  healthReply,
  type HealthReply,
  keepIdleConnections,
  LAUNCH_ID_ENV,
  listen,
  LISTEN_BACKLOG,
  type ListeningServer,
  type ListenOptions,
} from '../server.js';
export {
  type AppConfigSchema,
  type CheckpointBlock,
  type CheckpointSettings,
  controlPoolLimits,
  dataPoolLimits,
  type Env,
  type HttpSettings,
  type KindConfigSchema,
  type KindConfigSchemas,
  loadStackFile,
  MCP_EXPOSURE_KEY,
  type ParseOptions,
  parseStackFile,
  type PoolLimits,
  SERVER_KINDS,
  type ServerKind,
  serversByKind,
  serverSettings,
  type ServerSettings,
  serverUrl,
  type StackSettings,
  type TelemetrySettings,
  type TokenCaptureSettings,
} from '../settings.js';
export {
  type Boundary,
  type BoundaryInput,
  type EpisodeContext,
  type EpisodeFlags,
  type EpisodeState,
  EpisodeSteps,
  type EpisodeStepsOptions,
  type EpisodeView,
  RecordedBoundary,
  type RunOptions,
  type StepMode,
} from '../steps.js';
export { appendEncoded, appendOnly, encodeJsonBytes, encodeOnce } from '../json-pieces.js';
export {
  type CheckpointRecord,
  DEFER_DECODE_MIN_BYTES,
  type Manifest,
  participantDir,
  type RawRecord,
  readParticipantState,
  type ReadParticipantStateOptions,
  readRawParticipantState,
  type ReadRawParticipantStateOptions,
  RECORD_FIELDS_JSON,
  STATE_SCHEMA_VERSION,
  writeParticipantState,
  type WriteParticipantStateOptions,
  WriteStop,
} from '../store.js';
export { closest, didYouMean, editDistance } from '../suggest.js';
export {
  type CallState,
  type GymEvent,
  GymMetrics,
  type GymMetricsOptions,
  type MetricsJson,
  METRICS_PATH,
} from '../telemetry/metrics.js';
export {
  ATTR_BYTES,
  ATTR_CHECKPOINT_ID,
  ATTR_CPU_MS,
  ATTR_INSTANCE,
  ATTR_KIND,
  ATTR_OUTCOME,
  ATTR_PARTICIPANTS,
  ATTR_PHASE,
  ATTR_PREPARED,
  ATTR_RECORDS,
  ATTR_SOURCE_ID,
  ATTR_STAGE,
  coordinateSpanName,
  operationSpanName,
  stageSpanName,
  tracingObserver,
} from '../telemetry/checkpoint-spans.js';
export { ATTR_CAPTURE_KEY } from '../telemetry/request-spans.js';
export { Channel, type ChannelOptions } from '../workers/channel.js';
export {
  WorkerCoordinator,
  type WorkerCoordinatorOptions,
  type WorkerLoss,
  type WorkerMessage,
} from '../workers/coordinator.js';
export {
  type CoordinatorServer,
  type ForwardedControl,
  serveCoordinator,
} from '../workers/coordinator-server.js';
export {
  encodeFrame,
  FrameError,
  FrameReader,
  MAX_FRAME_BYTES,
  WithBytes,
} from '../workers/frames.js';
export { type HandedRecord } from '../workers/handed-records.js';
export { claimKeyOf, HeldRecords, recordAs } from '../workers/held.js';
export { type MarksRelay, RelayedMarks } from '../workers/marks.js';
export {
  type CoordinatedRecords,
  PARTICIPANT_MESSAGES,
  ParticipantCoordinator,
  type ParticipantCoordinatorOptions,
  type ParticipantWorkerReport,
  type WorkerExport,
} from '../workers/participant-coordinator.js';
export {
  type CoordinatorCalls,
  ParticipantWorker,
  type RestoredClaims,
} from '../workers/participant-worker.js';
export { mergeReadiness, mergeStatuses, replyTimeoutMs } from '../workers/rules.js';
export {
  manifestOwners,
  SESSION_MESSAGES,
  SessionCoordinator,
  type SessionCoordinatorOptions,
  type SessionParticipant,
  type SessionRecords,
  SessionWorker,
} from '../workers/session-coordinator.js';
export {
  cleanStaleRuntimeDirs,
  createRuntimeDir,
  type RuntimeDir,
} from '../workers/runtime-dir.js';
export {
  isRoutingId,
  newRoutingId,
  ownedName,
  parseOwnedName,
  type RoutingTables,
  type SessionRef,
  sessionTarget,
} from '../workers/session-owners.js';
export {
  type OneCopy,
  oneCopyPerSession,
  type Placement,
  type PlacementInput,
  type PlacementWorker,
  placeSessions,
  type SessionCopy,
} from '../workers/session-placement.js';
export {
  type RoutingState,
  type SessionOf,
  SessionRouter,
  type SessionRouterOptions,
  workerSocketPath,
} from '../workers/session-router.js';
export {
  type ChannelError,
  type ChannelHandler,
  type ChannelMessage,
  type ChannelReply,
  type ChannelRequest,
  COORDINATOR_SOCKET_ENV,
  type CoordinatorHooks,
  type ImmediateHandler,
  type JoinState,
  LAYER_MESSAGES,
  type LayerMessage,
  MESSAGE_TIMEOUT_MS,
  type NumberedReport,
  REPLY_GRACE_MS,
  RUNTIME_DIR_ENV,
  type WorkerAdmissionRequest,
  WORKER_INDEX_ENV,
  type WorkerInfo,
  type WorkerRegistration,
  type WorkerReport,
  type WorkerSide,
  type WorkerStatus,
} from '../workers/types.js';
export { WorkerLink, type WorkerLinkOptions } from '../workers/worker-link.js';
