// The worker-coordination layer: one participant for a server with several worker processes.
export * from './channel.js';
export * from './coordinator.js';
export * from './coordinator-server.js';
export * from './frames.js';
export * from './held.js';
export * from './marks.js';
export * from './participant-coordinator.js';
export * from './participant-worker.js';
export * from './primary.js';
export * from './rules.js';
export * from './runtime-dir.js';
export * from './session-coordinator.js';
export * from './session-owners.js';
export * from './session-placement.js';
export * from './session-router.js';
export * from './types.js';
export * from './worker-link.js';
