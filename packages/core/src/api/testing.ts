/**
 * In-memory stand-ins for testing a participant against core: a fake clock for the control plane,
 * a logger that keeps its lines, a gate a test opens by hand, tracing into memory, and a live connection's TCP keep-alive timer. `@ckpt-gym/testing` builds its
 * kit on them.
 *
 * @module
 */
export { FakeClock, settle } from '../testing/fake-clock.js';
export { Gate } from '../testing/gate.js';
export { type LogLine, MemoryLogger } from '../testing/memory-logger.js';
export { tcpKeepAliveTimerOn } from '../testing/tcp-timers.js';
export { InMemoryTracing, type ReadableSpan } from '../testing/tracing.js';
