/**
 * Token lineage and generation cuts for a worker that captures token ids: message hashes, the
 * lineage wire models, staging helpers and the rebuild of a rollout's token history.
 *
 * @module
 */
export {
  assistantFingerprint,
  conversationDigest,
  EXTRAS_DIGEST_VERSION,
  FINGERPRINT_VERSION,
  STAGING_DIGEST_VERSION,
  STAGING_SCHEMA_VERSION,
  type StagingDigestFields,
  type StagingDigestFn,
} from '../capture/hashes.js';
export {
  type LineageManifest,
  type LinearizedRollout,
  verifyAndLinearize,
} from '../capture/rebuild.js';
export {
  beginCall,
  type BeginCallOptions,
  buildPrefixRecord,
  completeCall,
  continuedPrompt,
  type LiveCall,
} from '../capture/staging.js';
export {
  buildInventory,
  type CaptureAdmission,
  CaptureValidationError,
  type CommitCoords,
  failureAck,
  type FinishReason,
  GENERATION_CUT_ROUTE,
  type GenerationCutContinuation,
  type GenerationCutInventory,
  type GenerationCutPrefix,
  type GenerationCutPrefixAck,
  type GenerationCutReceipt,
  parseCommitCoords,
  parseContinuation,
  parseInventory,
  rootCaptureAdmission,
  type StagedCallRecord,
  validateReceiptFor,
} from '../capture/wire.js';
