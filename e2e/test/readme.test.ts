/**
 * The READMEs' command blocks, run as written: each block's commands in order, in one bash from the
 * repository root (as a user pastes them into one terminal), against the example's fixed ports
 * 8100–8105. Every command must exit 0, and what the README says happened must have happened.
 * `npx ckpt-gym` must work as the README says; nothing maps it to the built CLI.
 *
 * Cleanup, also after a failure: the block's bash and its background jobs (one process group) are
 * killed, a stack still up is stopped through the built CLI, and what the test created
 * (`.ckpt-gym/run`, `sdk.mjs`, the example's token-capture directory) is removed.
 */
import { type ChildProcess, spawn, spawnSync } from 'node:child_process';
import { once } from 'node:events';
import { existsSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createServer as createHttpServer, type Server as HttpServer } from 'node:http';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';

import {
  CLI_MAIN,
  CollectionDir,
  CONTROLLER_FILE,
  loadStack,
  parseCommandLine,
  parseTasks,
} from '@ckpt-gym/coordinator-cli';

const REPO = resolve(import.meta.dirname, '../..');
const RUN_DIR = join(REPO, '.ckpt-gym/run');
const SDK_FILE = join(REPO, 'sdk.mjs');
const EXAMPLE = join(REPO, 'examples/local.yaml');
const TASKS = join(REPO, 'examples/tasks.jsonl');
// token_capture.dir of examples/local.yaml, relative to the file.
const EXAMPLE_CAPTURE = join(REPO, 'examples/.ckpt-gym');
const EXAMPLE_PORTS = [8100, 8101, 8102, 8103, 8104, 8105];
// A block that has not finished by then is killed and its hung command reported; jest's own
// timeout of each test comes later.
const BLOCK_LIMIT_MS = 180_000;
const BLOCK_TIMEOUT_MS = 240_000;

const rootReadme = readFileSync(join(REPO, 'README.md'), 'utf8');
const cliReadme = readFileSync(join(REPO, 'packages/coordinator-cli/README.md'), 'utf8');
const policyReadme = readFileSync(join(REPO, 'packages/policy-model-server/README.md'), 'utf8');

// --- Markdown ------------------------------------------------------------------------------------

/**
 * The text under `heading` (a whole line, e.g. `## Use it`) up to the next heading of any level
 * (`#` lines inside fenced blocks are shell comments, not headings).
 */
function section(markdown: string, heading: string): string {
  const lines = markdown.split('\n');
  const start = lines.indexOf(heading);
  if (start < 0) throw new Error(`no heading '${heading}'`);
  let fenced = false;
  const end = lines.findIndex((line, i) => {
    if (line.startsWith('```')) fenced = !fenced;
    return i > start && !fenced && /^#{1,6} /.test(line);
  });
  return lines.slice(start + 1, end < 0 ? undefined : end).join('\n');
}

/** The bodies of the fenced blocks of `lang` in `text`, in order. */
function fences(text: string, lang: string): string[] {
  const found = [...text.matchAll(/^```(\w*)\n([\s\S]*?)^```$/gm)];
  return found.filter((m) => m[1] === lang).map((m) => m[2]!);
}

/** A shell block's commands: `\` continuations joined, blank and comment-only lines dropped. */
function commands(block: string): string[] {
  return block
    .replace(/\\\n/g, ' ')
    .split('\n')
    .map((line) => line.trim())
    .filter((line) => line !== '' && !line.startsWith('#'));
}

function onlyBlock(text: string, lang: string, where: string): string {
  const blocks = fences(text, lang);
  if (blocks.length !== 1) throw new Error(`${where}: ${blocks.length} \`${lang}\` blocks, want 1`);
  return blocks[0]!;
}

// --- running a block -----------------------------------------------------------------------------

interface CommandOutcome {
  command: string;
  /** Its exit code, or 'hung' when the block ran out of time in it. */
  exit: number | 'hung';
}

let running: ChildProcess | undefined;

/**
 * Runs `cmds` in order in one bash (its own process group) from the repository root; stops at the
 * first that exits non-zero, or kills the group once `limitMs` passed. Resolves with each command's
 * exit code and everything bash printed.
 */
async function runBlock(
  cmds: string[],
  limitMs: number,
): Promise<{ outcomes: CommandOutcome[]; output: string }> {
  const rcFile = join(tmpdir(), `ckpt-gym-readme-${process.pid}-${Date.now()}.rc`);
  const script = cmds
    .map(
      (command, i) =>
        `${command}\n__rc=$?; echo "${i} $__rc" >> "$README_RC_FILE"; [ "$__rc" -eq 0 ] || exit 1`,
    )
    .join('\n');
  const child = spawn('bash', ['-c', script], {
    cwd: REPO,
    detached: true,
    env: { ...process.env, README_RC_FILE: rcFile },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  running = child;
  let output = '';
  child.stdout.on('data', (chunk: Buffer) => (output += chunk.toString()));
  child.stderr.on('data', (chunk: Buffer) => (output += chunk.toString()));
  let hung = false;
  const timer = setTimeout(() => {
    hung = true;
    process.kill(-child.pid!, 'SIGKILL');
  }, limitMs);
  // 'exit', not 'close': a background job of the block may keep the pipes open.
  await new Promise((done) => child.once('exit', done));
  clearTimeout(timer);
  const recorded = existsSync(rcFile) ? readFileSync(rcFile, 'utf8') : '';
  rmSync(rcFile, { force: true });
  const outcomes: CommandOutcome[] = recorded
    .split('\n')
    .filter(Boolean)
    .map((line) => {
      const [index, exit] = line.split(' ').map(Number);
      return { command: cmds[index!]!, exit: exit! };
    });
  if (hung) outcomes.push({ command: cmds[outcomes.length]!, exit: 'hung' });
  return { outcomes, output };
}

/** Runs the block and expects every command to have run and exited 0 (the output on failure). */
async function expectBlockRuns(cmds: string[]): Promise<string> {
  const { outcomes, output } = await runBlock(cmds, BLOCK_LIMIT_MS);
  const everyOk = cmds.map((command) => ({ command, exit: 0 }));
  if (JSON.stringify(outcomes) !== JSON.stringify(everyOk)) {
    process.stderr.write(`README block output:\n${output.slice(-6000)}\n`);
  }
  expect(outcomes).toEqual(everyOk);
  return output;
}

function canBind(port: number): Promise<boolean> {
  return new Promise((done) => {
    const server = createServer();
    server.once('error', () => done(false));
    server.listen(port, '127.0.0.1', () => server.close(() => done(true)));
  });
}

/** An OTLP/HTTP JSON receiver on `port`: the names of the spans posted to it. */
async function otlpNames(port: number): Promise<{ names: string[]; server: HttpServer }> {
  const names: string[] = [];
  const server = createHttpServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (chunk: Buffer) => chunks.push(chunk));
    req.on('end', () => {
      const body = JSON.parse(Buffer.concat(chunks).toString('utf8')) as {
        resourceSpans?: { scopeSpans?: { spans?: { name: string }[] }[] }[];
      };
      for (const resource of body.resourceSpans ?? []) {
        for (const scope of resource.scopeSpans ?? []) {
          for (const span of scope.spans ?? []) names.push(span.name);
        }
      }
      res.writeHead(200, { 'content-type': 'application/json' }).end('{}');
    });
  });
  server.listen(port, '127.0.0.1');
  await once(server, 'listening');
  return { names, server };
}

// --- the blocks ----------------------------------------------------------------------------------

interface ResultLine {
  rollout_id: string;
  result: { reward?: number } | null;
  failure: unknown;
}

function exportedEpisodes(checkpointDir: string): string[] {
  const record = JSON.parse(readFileSync(join(checkpointDir, CONTROLLER_FILE), 'utf8')) as {
    episode_ids: string[];
  };
  return record.episode_ids;
}

describe('README command blocks, on the example ports', () => {
  const captureExisted = existsSync(EXAMPLE_CAPTURE);
  /** Set once the checks passed: only then is what the blocks write this test's to remove. */
  let owned = false;

  beforeAll(async () => {
    // The blocks write into these and `run` skips rollouts its output already holds: never reuse them.
    for (const path of [RUN_DIR, SDK_FILE]) {
      if (existsSync(path))
        throw new Error(`${path} exists; remove it to run the README's commands`);
    }
    for (const port of EXAMPLE_PORTS) {
      if (!(await canBind(port)))
        throw new Error(`127.0.0.1:${port} is in use; the example needs it`);
    }
    owned = true;
  });

  afterEach(() => {
    if (!owned) return;
    // The block's bash and the background jobs it left, all in its process group.
    if (running?.pid !== undefined) {
      try {
        process.kill(-running.pid, 'SIGKILL');
      } catch {
        // the group is gone
      }
    }
    running = undefined;
    if (existsSync(join(RUN_DIR, 'run.json'))) {
      spawnSync(process.execPath, [CLI_MAIN, 'down', '--run-dir', RUN_DIR, '--grace', '5'], {
        cwd: REPO,
        stdio: 'ignore',
      });
    }
    rmSync(RUN_DIR, { recursive: true, force: true });
    rmSync(SDK_FILE, { force: true });
    if (!captureExisted) rmSync(EXAMPLE_CAPTURE, { recursive: true, force: true });
  });

  afterAll(() => {
    if (!owned) return;
    // .ckpt-gym itself, when the blocks left it empty.
    spawnSync('rmdir', [join(REPO, '.ckpt-gym')], { stdio: 'ignore' });
  });

  test(
    "root README, 'Use it': collect, checkpoint in flight, crash, resume, every task finished",
    async () => {
      await expectBlockRuns(commands(onlyBlock(section(rootReadme, '## Use it'), 'sh', 'Use it')));

      const keys = parseTasks(readFileSync(TASKS, 'utf8')).map((t) => t.key);
      expect(keys.length).toBeGreaterThan(0);
      const latest = new CollectionDir(join(RUN_DIR, 'collection')).latest();
      const runId = latest!.manifest.run_id;
      const rollouts = keys.map((key) => `${runId}.${key}`);
      const exported = exportedEpisodes(latest!.dir);
      expect(exported.length).toBeGreaterThan(0);
      expect(rollouts).toEqual(expect.arrayContaining(exported));

      const results = readFileSync(join(RUN_DIR, 'results.jsonl'), 'utf8')
        .split('\n')
        .filter(Boolean)
        .map((line) => JSON.parse(line) as ResultLine);
      expect(results.map((r) => r.rollout_id).sort()).toEqual([...rollouts].sort());
      for (const row of results) {
        expect([row.rollout_id, row.failure, row.result?.reward]).toEqual([
          row.rollout_id,
          null,
          1,
        ]);
      }
    },
    BLOCK_TIMEOUT_MS,
  );

  test(
    "root README, 'Your own agent': the openai SDK snippet, then a checkpoint that names its key",
    async () => {
      const part = section(rootReadme, '### Your own agent: the OpenAI endpoint');
      writeFileSync(SDK_FILE, onlyBlock(part, 'js', 'Your own agent'));
      const output = await expectBlockRuns(commands(onlyBlock(part, 'sh', 'Your own agent')));

      expect(output).toContain('"name":"get_weather"');
      expect(exportedEpisodes(join(RUN_DIR, 'checkpoints/sdk'))).toEqual(['my-rollout']);
    },
    BLOCK_TIMEOUT_MS,
  );

  test(
    "root README, 'Telemetry': /metrics, one status --watch line, a traced checkpoint reaching a collector on 4318",
    async () => {
      const part = section(rootReadme, '### Telemetry');
      const collector = await otlpNames(4318);
      let output: string;
      try {
        output = await expectBlockRuns(commands(onlyBlock(part, 'sh', 'Telemetry')));
      } finally {
        collector.server.close();
      }
      expect(output).toContain(
        'gym_checkpoint_operation_duration_ms_count{server="policy",kind="model",operation="prepare"',
      );
      const watchLine = output.split('\n').find((line) => line.startsWith('{"at":'));
      expect(JSON.parse(watchLine!)).toMatchObject({ servers: expect.any(Array) });
      expect(existsSync(join(RUN_DIR, 'traced', CONTROLLER_FILE))).toBe(true);
      // The CLI exports as it exits, each server as `down` stops it.
      expect(collector.names).toEqual(
        expect.arrayContaining(['ckpt-gym checkpoint', 'gym.checkpoint.prepare']),
      );
    },
    BLOCK_TIMEOUT_MS,
  );

  test(
    "CLI README, 'Examples': one-shot and step-by-step checkpoints, restore after a crash",
    async () => {
      await expectBlockRuns(
        commands(onlyBlock(section(cliReadme, '### Examples'), 'sh', 'Examples')),
      );

      const checkpoints = ['step-100', 'step-200'].map((id) => join(RUN_DIR, 'checkpoints', id));
      for (const dir of checkpoints) expect(existsSync(join(dir, CONTROLLER_FILE))).toBe(true);
    },
    BLOCK_TIMEOUT_MS,
  );

  test(
    "CLI README, 'Running a stack': up, checkpoint --stop, crash, up, restore, down",
    async () => {
      const part = section(cliReadme, '## Running a stack');
      await expectBlockRuns(commands(onlyBlock(part, 'sh', 'Running a stack')));

      expect(existsSync(join(RUN_DIR, 'checkpoints/c1', CONTROLLER_FILE))).toBe(true);
      expect(existsSync(join(RUN_DIR, 'run.json'))).toBe(false);
    },
    BLOCK_TIMEOUT_MS,
  );
});

// --- held responses and client timeouts (the behaviour: policy-model-server's gate tests) -------

test("the client-timeout rule is stated in the policy model's README and the root README", () => {
  const statements = [
    section(policyReadme, '## Held responses and client timeouts'),
    section(rootReadme, '### Your own agent: the OpenAI endpoint'),
  ];
  for (const text of statements.map((s) => s.replace(/\s+/g, ' '))) {
    expect(text).toMatch(/timeout above the checkpoint's deadline plus (its|that) lease/i);
    for (const option of [
      'timeout',
      'maxRetries',
      'timeout=',
      'max_retries=',
      'lease_grace_seconds',
    ]) {
      expect(text).toContain(`\`${option}`);
    }
  }
});

test("the README's SDK snippet waits longer than a checkpoint of the example can hold its call", () => {
  const snippet = onlyBlock(
    section(rootReadme, '### Your own agent: the OpenAI endpoint'),
    'js',
    'SDK',
  );
  const timeoutMs = Number(/\btimeout: ([\d_]+)/.exec(snippet)?.[1]?.replaceAll('_', ''));
  const parsed = parseCommandLine(['checkpoint', '--dir', 'c']);
  if (parsed.kind !== 'invoke') throw new Error('checkpoint --dir c did not parse');
  const lease = loadStack(EXAMPLE, {}).checkpoint!.leaseGraceSeconds;
  expect(timeoutMs).toBeGreaterThan((parsed.invocation.deadlineSeconds + lease) * 1000);
});
