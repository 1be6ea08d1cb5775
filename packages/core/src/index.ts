// The public API of @ckpt-gym/core. Other packages import only from here.
export * from './errors.js';
export * from './identity.js';
