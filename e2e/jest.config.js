import { jestConfig } from '../jest.config.base.js';

export default {
  ...jestConfig(import.meta.dirname, { packagesDir: '<rootDir>/../packages' }),
  // Every test starts real server processes: one file at a time keeps 2 cores from starving them.
  maxWorkers: 1,
  testTimeout: 120000,
};
