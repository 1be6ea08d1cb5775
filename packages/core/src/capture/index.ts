// Token lineage and generation cuts: hashes, wire models, worker staging helpers, rebuild.
export * from './hashes.js';
export * from './wire.js';
export * from './staging.js';
export * from './rebuild.js';
