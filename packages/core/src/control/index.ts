// The participant control plane: phases, request schemas, the plane, its observer and its routes.
export { type ControlClock, forEachBounded, systemClock, withinDeadline } from './deadline.js';
export {
  type ControlObserver,
  logObserver,
  type ObservedOperation,
  type OperationEvent,
  type RefusalEvent,
  type StageName,
  type StageTiming,
} from './observer.js';
export { type LastCheckpoint, type LastOperation } from './last-checkpoint.js';
export * from './phases.js';
export * from './plane.js';
export { READINESS_POLL_MS } from './readiness.js';
export * from './replies.js';
export * from './routes.js';
export * from './schemas.js';
export type { ControlStorage, ParticipantStorageOptions } from './storage.js';
