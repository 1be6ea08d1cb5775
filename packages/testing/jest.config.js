import { jestConfig } from '../../jest.config.base.js';

export default jestConfig(import.meta.dirname);
