// The public API of @ckpt-gym/core. Other packages import only from here.
export * from './errors.js';
export * from './identity.js';
export * from './settings.js';
export * from './logging.js';
export * from './store.js';
export * from './fsync.js';
export * from './steps.js';
export * from './idle-queue.js';
export * from './express.js';
export * from './control/index.js';
export * from './http-client.js';
export * from './coordination.js';
export * from './json.js';
export * from './participant.js';
export * from './server.js';
export * from './capture/index.js';
export * from './headers.js';
export { checkToolCalls } from './openai.js';
