// The public API of @ckpt-gym/policy-model-server.
export {
  CAPTURE_CONTROL_PREFIX,
  MAX_REMOVAL_BATCH,
  type PolicyModelOptions,
  type PolicyModelServer,
  createPolicyModelServer,
  removalIds,
} from './app.js';
export { POLICY_CONFIG_SCHEMA, type PolicyModelConfig, policyModelConfig } from './config.js';
export { policyModelKind } from './kind.js';
export { GateMarks, PolicyGate, type Ticket } from './gate.js';
export {
  CaptureLedger,
  FENCE_SUFFIX,
  LEDGER_SUFFIX,
  LedgerRetiredError,
  type LedgerManifest,
  LOCK_DIR,
  LOCK_STRIPES,
  ROLLOUT_FENCE_SUFFIX,
  lockStripe,
  type RolloutRemoval,
  STARTED_SUFFIX,
  TOKEN_SUFFIXES,
  keyOfFile,
} from './ledger.js';
export { type ModelRecord, PolicyParticipant, UNTAGGED_BLOCKER, stampRows } from './participant.js';
export {
  BackendClient,
  GENERATION_BODY_LIMIT,
  type ProxyOptions,
  backendTarget,
  createProxyRouter,
  ledgerRow,
} from './proxy.js';
export {
  type ChatMessage,
  type ChatToolCall,
  type ResponseUsage,
  ResponsesStream,
  chatToResponse,
  inputToMessages,
  responseIdFor,
  responsesToChatRequest,
} from './responses.js';
export { type SseEvent, SseReader, parseSseEvent } from './sse.js';
export {
  type CutOptions,
  type CutRecord,
  type CuttableCall,
  GenerationCuts,
  generationCutUrl,
  parseCutRecord,
} from './cuts.js';
export {
  type CallLineage,
  type Resolution,
  INVALID_COORDS,
  MISSING_COORDS,
  PARENT_WITHOUT_CHAIN_REASON,
  UNRESOLVED_PARENT_REASON,
  WORKER_CAPTURE_FAILED,
  captureAdmission,
  cutRestartReason,
  lineageColumns,
  resolveParent,
} from './lineage.js';
