// The public API of @ckpt-gym/environment-server.
export * from './protocol.js';
export * from './participant.js';
export * from './single-agent-turn.js';
export * from './legacy.js';
export * from './app.js';
export * from './registry.js';
export * from './config.js';
export * from './kind.js';
