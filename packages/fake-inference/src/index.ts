// The public API of @ckpt-gym/fake-inference.
export {
  DEFAULT_MODEL,
  type FakeInferenceOptions,
  type FakeInferenceState,
  type ListenOptions,
  type RunningFakeInference,
  createFakeInferenceApp,
  startFakeInference,
} from './app.js';
export {
  type AdmittedCall,
  type CallRecord,
  type CallTokens,
  type CallView,
  CallLog,
  TokenStore,
  tokenize,
} from './calls.js';
export {
  type CallPosition,
  type HoldPolicy,
  type WaitReason,
  NO_HOLD,
  WaitQueue,
  waitReason,
} from './holds.js';
export {
  type AssistantReply,
  type ChatMessage,
  type Script,
  type ScriptName,
  type ToolCall,
  type ToolCallSpec,
  SCRIPTS,
  ScriptBook,
  parseScript,
  scriptedReply,
  toolTurnAt,
} from './script.js';
export {
  type CapturedCall,
  CUT_KEY_PREFIX,
  EFFECTIVE_OUTPUT_LIMIT,
  TOKEN_LOGPROB,
  WEIGHT_VERSION,
  captureFailedCoords,
  cutRound,
  finishCapture,
  generate,
  generateRest,
  openCapture,
} from './capture.js';
export {
  FAKE_INFERENCE_APP,
  FAKE_INFERENCE_CONFIG_SCHEMA,
  type FakeInferenceConfig,
  fakeInferenceConfig,
} from './config.js';
export { fakeInferenceKind } from './kind.js';
