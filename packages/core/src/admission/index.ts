// The admission gate and the per-kind rules it applies.
export * from './gate.js';
export * from './rules.js';
