/**
 * Every body one server sends another: its type (the sender builds a value of it) and its parser
 * `(body: unknown) => T` (an ajv schema compiled once; a refusal is 422 `invalid_request` naming
 * the field), which the receiver's route calls.
 *
 *   contract                     sender                      receiver
 *   agent-sessions.ts            environment server          agent server
 *   resources-sessions.ts        environment server          resources server
 *   run.ts (/run, legacy rows)   collector                   environment and agent servers
 *   chat.ts                      policy model server         its backend worker (the fake)
 *
 * The control bodies are `control/schemas.ts`; the capture wire (admission, coordinates, cut
 * receipts) is `capture/wire.ts`, with `rootCaptureAdmission`.
 */
export {
  type AgentCloseRequest,
  type AgentSeedReply,
  type AgentSeedRequest,
  type CloseReceipt,
  type DirectHttpGrant,
  type DirectHttpToolAccess,
  type McpGrant,
  type McpToolAccess,
  type ToolAccess,
  activationHeader,
  parseActivationHeader,
  parseAgentCloseRequest,
  parseAgentSeedRequest,
  parseDirectHttpGrant,
  parseMcpGrant,
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
