// The participant control plane: phases, request schemas, the plane and its routes.
export { type ControlClock, forEachBounded, systemClock, withinDeadline } from './deadline.js';
export * from './phases.js';
export * from './plane.js';
export * from './routes.js';
export * from './schemas.js';
