import js from '@eslint/js';
import tseslint from 'typescript-eslint';

export default tseslint.config(
  { ignores: ['**/dist/**', '**/node_modules/**', '**/.turbo/**'] },
  js.configs.recommended,
  ...tseslint.configs.recommended,
  {
    rules: {
      '@typescript-eslint/no-unused-vars': [
        'error',
        { argsIgnorePattern: '^_', varsIgnorePattern: '^_' },
      ],
      'no-constant-condition': ['error', { checkLoops: false }],
    },
  },
  // Type-aware rules: each file is checked with the types of its package's tsconfig.json (the bins,
  // in no tsconfig, with the default project). Other packages' types come from their built dist/,
  // which is why turbo builds the dependencies before it lints.
  {
    files: ['**/*.ts', 'packages/*/bin/*.js'],
    languageOptions: {
      parserOptions: {
        projectService: { allowDefaultProject: ['packages/*/bin/*.js'] },
        tsconfigRootDir: import.meta.dirname,
      },
    },
    rules: {
      // Only errors are thrown: an error body, a log line and `cause` all need an Error.
      '@typescript-eslint/only-throw-error': 'error',
    },
  },
  // No function over 80 lines in the packages' sources (a longer one says why in a comment and
  // disables the rule there).
  {
    files: ['packages/*/src/**'],
    rules: {
      'max-lines-per-function': ['error', { max: 80, skipBlankLines: true, skipComments: true }],
    },
  },
);
