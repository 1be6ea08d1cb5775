// Every body one server sends another: its type and its parser (an ajv schema compiled once).
export {
  type AgentCloseRequest,
  type AgentSeedReply,
  type AgentSeedRequest,
  type CloseReceipt,
  type DirectHttpGrant,
  type DirectHttpToolAccess,
  type McpGrant,
  type ToolAccess,
  activationHeader,
  parseActivationHeader,
  parseAgentCloseRequest,
  parseAgentSeedRequest,
  parseDirectHttpGrant,
} from './agent-sessions.js';
export {
  type NativeCloseRequest,
  type NativeSeedReply,
  type NativeSeedRequest,
  type ResourcesTaskId,
  type ResourcesTools,
  isNativeBody,
  parseNativeCloseRequest,
  parseNativeSeedRequest,
} from './resources-sessions.js';
export {
  type AggregateMetricsRequest,
  type EpisodeRequest,
  type LegacyRunRow,
  type Task,
  type TaskId,
  parseAggregateMetricsRequest,
  parseEpisodeRequest,
  parseLegacyRunRow,
} from './run.js';
export {
  type EpisodeIdJson,
  isSessionId,
  MAX_SESSION_ID_CHARS,
  SESSION_ID_REASON,
} from './validate.js';
export { type ChatCompletionRequest, parseChatCompletionRequest } from './chat.js';
