export { FakeClock, settle } from '../../src/testing/index.js';
