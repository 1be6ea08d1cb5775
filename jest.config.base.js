// Shared jest settings: TypeScript through swc, native ESM, and workspace packages resolved to
// their sources so a package's tests never need its dependencies rebuilt first.
export function jestConfig(rootDir, { packagesDir = '<rootDir>/..' } = {}) {
  return {
    rootDir,
    testEnvironment: 'node',
    extensionsToTreatAsEsm: ['.ts'],
    testMatch: ['<rootDir>/test/**/*.test.ts'],
    transform: {
      '^.+\\.ts$': [
        '@swc/jest',
        {
          jsc: { parser: { syntax: 'typescript' }, target: 'es2022' },
          module: { type: 'es6' },
        },
      ],
    },
    moduleNameMapper: {
      '^@ckpt-gym/([a-z-]+)$': `${packagesDir}/$1/src/index.ts`,
      '^@ckpt-gym/([a-z-]+)/([a-z-]+)$': `${packagesDir}/$1/src/api/$2.ts`,
      '^(\\.{1,2}/.*)\\.js$': '$1',
    },
    testTimeout: 30000,
  };
}
