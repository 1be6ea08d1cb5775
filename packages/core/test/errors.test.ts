import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

import express, { type Request, type Response } from 'express';
import ts from 'typescript';

import {
  CkptGymError,
  ERROR_CATALOGUE,
  errorFromBody,
  isCkptGymError,
  StaleAttemptError,
  toClientError,
} from '../src/errors.js';

const ERRORS_SOURCE = join(import.meta.dirname, '../src/errors.ts');

describe('the error catalogue', () => {
  test('docs/errors.md lists every code with its HTTP status and retry rule, and no code the catalogue lacks', () => {
    const doc = readFileSync(join(import.meta.dirname, '../../../docs/errors.md'), 'utf8');
    const codesTable = doc.slice(doc.indexOf('\n## Codes\n'));
    const rows = new Map(
      [...codesTable.matchAll(/^\| `([a-z_]+)` \| ([^|]+) \| ([^|]+) \|/gm)].map((m) => [
        m[1]!,
        [m[2]!.trim(), m[3]!.trim()],
      ]),
    );
    for (const [code, { status, retry }] of Object.entries(ERROR_CATALOGUE)) {
      // invalid_config never reaches a client: the process exits before it listens.
      const http = code === 'invalid_config' ? '—' : `${status}`;
      expect([code, rows.get(code)]).toEqual([code, [http, retry]]);
    }
    expect([...rows.keys()].filter((code) => !(code in ERROR_CATALOGUE))).toEqual([]);
  });

  test('an upstream reply carrying a ckpt-gym error keeps its code; any other body is a 502 upstream_error', () => {
    const refusal = errorFromBody(409, { error: { code: 'admission_closed', detail: 'closed' } });
    expect([refusal.code, refusal.status, refusal.detail]).toEqual([
      'admission_closed',
      409,
      'closed',
    ]);
    for (const body of [undefined, '<html>bad gateway</html>', { error: { code: 'nope' } }]) {
      const err = errorFromBody(503, body);
      expect([err.code, err.status]).toEqual(['upstream_error', 502]);
      expect(err.detail).toMatch(/^HTTP 503/);
    }
  });

  test('anything unknown reaches a client as internal_error without its message', () => {
    const err = toClientError(new Error('secret path /etc/x'));
    expect(err.toBody()).toEqual({
      error: { code: 'internal_error', detail: 'internal server error' },
    });
  });

  test('a failure to read a request body is a client error: 413 for its size, 422 for anything else', () => {
    // What body-parser and raw-body raise: an HTTP status, and expose: true for a client's fault.
    const bodyError = (status: number, message: string, props: object = {}) =>
      Object.assign(new Error(message), { status, expose: status < 500, ...props });
    const cases: [Error, string, string][] = [
      [
        bodyError(400, 'unexpected end of file', { code: 'Z_BUF_ERROR', errno: -5 }),
        'invalid_request',
        'request body could not be decompressed: unexpected end of file',
      ],
      [
        bodyError(415, 'unsupported content encoding "x"', { type: 'encoding.unsupported' }),
        'invalid_request',
        'request body could not be read: unsupported content encoding "x"',
      ],
      [
        bodyError(415, 'unsupported charset "LATIN1"', { type: 'charset.unsupported' }),
        'invalid_request',
        'request body could not be read: unsupported charset "LATIN1"',
      ],
      [
        bodyError(400, 'request size did not match content length', {
          type: 'request.size.invalid',
        }),
        'invalid_request',
        'request body could not be read: request size did not match content length',
      ],
      [
        bodyError(400, 'Unexpected token', { type: 'entity.parse.failed' }),
        'invalid_request',
        'request body is not valid JSON: Unexpected token',
      ],
      [
        bodyError(413, 'request entity too large', { type: 'entity.too.large' }),
        'payload_too_large',
        'request body is too large',
      ],
      // A server-side failure while reading stays internal.
      [
        bodyError(500, 'stream is not readable', { type: 'stream.not.readable' }),
        'internal_error',
        'internal server error',
      ],
      [Object.assign(new Error('x'), { status: 400 }), 'internal_error', 'internal server error'],
    ];
    for (const [err, code, detail] of cases) {
      const client = toClientError(err);
      expect([err.message, client.code, client.detail]).toEqual([err.message, code, detail]);
    }
  });

  test("express's router refusing a path parameter that is not percent-encoded UTF-8 is 422 invalid_request", async () => {
    const router = express.Router();
    router.get('/rollouts/:id', (_req, res) => res.end());
    for (const id of ['%ZZ', '%ED%A0%80', '%']) {
      // What the router hands the error middleware (its URIError, with status 400).
      const routed = await new Promise<unknown>((resolve) => {
        const req = { method: 'GET', url: `/rollouts/${id}`, headers: {} } as Request;
        router(req, {} as Response, resolve);
      });
      const client = toClientError(routed);
      expect([id, client.code, client.status, client.detail]).toEqual([
        id,
        'invalid_request',
        422,
        `a request path parameter is not percent-encoded UTF-8: Failed to decode param '${id}'`,
      ]);
    }
    // Only the router's: a URIError our own code raises is a bug, not the client's.
    expect(toClientError(new URIError('URI malformed')).code).toBe('internal_error');
  });
});

describe('the error classes', () => {
  let dir: string;
  beforeAll(() => {
    dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-errors-'));
  });
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  // What a package built against @ckpt-gym/core sees: the declaration tsc emits for errors.ts.
  function compileAgainstDeclaration(consumer: string): {
    program: ts.Program;
    diagnostics: string[];
  } {
    const options: ts.CompilerOptions = {
      strict: true,
      target: ts.ScriptTarget.ES2022,
      module: ts.ModuleKind.NodeNext,
      moduleResolution: ts.ModuleResolutionKind.NodeNext,
      types: [],
      skipLibCheck: true,
    };
    const emitted = ts
      .createProgram([ERRORS_SOURCE], { ...options, declaration: true, emitDeclarationOnly: true })
      .emit(undefined, (name, text) => {
        if (name.endsWith('.d.ts')) writeFileSync(join(dir, 'errors.d.ts'), text);
      });
    expect(emitted.diagnostics).toEqual([]);
    writeFileSync(join(dir, 'consumer.ts'), consumer);
    const program = ts.createProgram([join(dir, 'consumer.ts')], { ...options, noEmit: true });
    const diagnostics = ts
      .getPreEmitDiagnostics(program)
      .map((d) => ts.flattenDiagnosticMessageText(d.messageText, '\n'));
    return { program, diagnostics };
  }

  test('the published declaration keeps every code class a subclass of CkptGymError with its code narrowed', () => {
    const { program, diagnostics } = compileAgainstDeclaration(`
      import { CkptGymError, StaleAttemptError } from './errors.js';
      const base: CkptGymError = new StaleAttemptError('x');
      const thrown: unknown = base;
      if (thrown instanceof StaleAttemptError) {
        const code: 'stale_attempt' = thrown.code;
        void code;
      }
    `);
    expect(diagnostics).toEqual([]);
    // Structure alone would pass the lines above for a mixin's anonymous class; a type-aware lint
    // (only-throw-error) and a reader need the nominal chain, so walk the declared base types.
    const checker = program.getTypeChecker();
    const declaration = program.getSourceFile(join(dir, 'errors.d.ts'))!;
    const chains: Record<string, string[]> = {};
    const codes: Record<string, string> = {};
    for (const statement of declaration.statements) {
      if (!ts.isClassDeclaration(statement) || !statement.name) continue;
      const type = checker.getTypeAtLocation(statement.name) as ts.InterfaceType;
      const chain: string[] = [];
      for (let base = checker.getBaseTypes(type)[0]; base;) {
        chain.push(base.symbol.name);
        base = base.isClassOrInterface() ? checker.getBaseTypes(base)[0] : undefined;
      }
      chains[statement.name.text] = chain;
      const code = checker.getTypeOfSymbol(type.getProperty('code')!);
      codes[statement.name.text] = code.isStringLiteral() ? code.value : checker.typeToString(code);
    }
    const { CkptGymError: base, ...subclasses } = chains;
    expect(base).toEqual(['Error']);
    expect(Object.keys(subclasses)).toHaveLength(Object.keys(ERROR_CATALOGUE).length);
    for (const [name, chain] of Object.entries(subclasses)) {
      expect([name, chain]).toEqual([name, ['CkptGymError', 'Error']]);
    }
    // One class per code, each with its code as a literal type (the base's is the ErrorCode union).
    const { CkptGymError: _union, ...subclassCodes } = codes;
    expect(Object.values(subclassCodes).sort()).toEqual(Object.keys(ERROR_CATALOGUE).sort());
  });

  test('an error from another copy of @ckpt-gym/core (a duplicate install) is a CkptGymError and reaches the client typed', async () => {
    const source = ts.transpileModule(readFileSync(ERRORS_SOURCE, 'utf8'), {
      compilerOptions: { target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ESNext },
    }).outputText;
    writeFileSync(join(dir, 'copy.mjs'), source);
    const copy = (await import(
      pathToFileURL(join(dir, 'copy.mjs')).href
    )) as typeof import('../src/errors.js');
    expect(copy.CkptGymError).not.toBe(CkptGymError);

    const foreign = new copy.StaleAttemptError('attempt 1 of rollout r was retired');
    expect([foreign instanceof CkptGymError, isCkptGymError(foreign)]).toEqual([true, true]);
    expect(toClientError(foreign).toBody()).toEqual({
      error: { code: 'stale_attempt', detail: 'attempt 1 of rollout r was retired' },
    });
    // Both ways round, and a subclass keeps the exact prototype check.
    expect(new StaleAttemptError('x') instanceof copy.CkptGymError).toBe(true);
    expect(foreign instanceof StaleAttemptError).toBe(false);
    expect(new StaleAttemptError('x') instanceof StaleAttemptError).toBe(true);
    for (const other of [new Error('x'), { code: 'stale_attempt' }, null, 'stale_attempt']) {
      expect([other, other instanceof CkptGymError, isCkptGymError(other)]).toEqual([
        other,
        false,
        false,
      ]);
    }
  });
});
