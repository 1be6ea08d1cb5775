/**
 * The in-memory doubles of core's own interfaces, for tests: a `FakeClock` (a `ControlClock`
 * that moves only when told), a `MemoryLogger` (a `Logger` that keeps its lines) and a `Gate`
 * (a promise opened by hand). They live in core, not in `@ckpt-gym/testing`, because core's own
 * tests need them and core cannot depend on the kit (the kit depends on core); the kit
 * re-exports them.
 */
export { FakeClock, settle } from './fake-clock.js';
export { Gate } from './gate.js';
export { type LogLine, MemoryLogger } from './memory-logger.js';
