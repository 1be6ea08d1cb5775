// The public API of @ckpt-gym/resources-server.
export * from './definition.js';
export * from './sessions.js';
export * from './participant.js';
export * from './cookie.js';
export * from './mcp.js';
export * from './mcp-token.js';
export * from './native.js';
export * from './responses.js';
export * from './app.js';
export * from './config.js';
export * from './kind.js';
export * from './servers/counter.js';
export * from './servers/weather.js';
export * from './servers/slow-verify.js';
export * from './servers/verifiers.js';
