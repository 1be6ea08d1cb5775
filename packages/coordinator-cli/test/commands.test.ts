/**
 * The checkpoint commands end to end, in-process: runCli against real core ControlPlane servers
 * (environment, model, resources) through a temporary stack file.
 */
import {
  cpSync,
  existsSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  writeFileSync,
} from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { participantDir, writeParticipantState } from '@ckpt-gym/core/server';

import { runCli } from '../src/index.js';
import { type CliRun, startStack, type TestStack, TOKEN_ENV } from './support/stack.js';

let dir: string;
let stack: TestStack;
const stacks: TestStack[] = [];

async function cli(args: string[], config = stack.file): Promise<CliRun> {
  const out = { stdout: '', stderr: '' };
  const code = await runCli([...args, '--config', config], {
    stdout: { write: (chunk: string) => (out.stdout += chunk) },
    stderr: { write: (chunk: string) => (out.stderr += chunk) },
    env: { [TOKEN_ENV]: 'test-token' },
    cwd: dir,
  });
  return { code, ...out };
}

async function cliJson(args: string[], config?: string): Promise<Record<string, unknown> & CliRun> {
  const run = await cli([...args, '--json'], config);
  return { ...run, ...(JSON.parse(run.stdout) as Record<string, unknown>) };
}

async function start(...args: Parameters<typeof startStack>): Promise<TestStack> {
  const started = await startStack(...args);
  stacks.push(started);
  return started;
}

beforeEach(async () => {
  dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-cli-'));
  stack = await start(dir);
});

afterEach(async () => {
  await Promise.all(stacks.splice(0).map((s) => s.close()));
  rmSync(dir, { recursive: true, force: true });
});

describe('discover and status', () => {
  test('discover lists the participants in prepare order', async () => {
    const run = await cli(['discover']);
    expect(run.code).toBe(0);
    const rows = run.stdout.split('\n').filter((line) => /^(env|policy|tools) /.test(line));
    expect(rows.map((line) => line.split(/\s+/)[0])).toEqual(['env', 'policy', 'tools']);

    const json = await cliJson(['discover']);
    expect(json.participants).toEqual([
      expect.objectContaining({ server: 'env', kind: 'environment' }),
      expect.objectContaining({ server: 'policy', kind: 'model' }),
      expect.objectContaining({ server: 'tools', kind: 'resources' }),
    ]);
  });

  test('discover names a server that is down and exits 1', async () => {
    const extra = await start(dir, [{ name: 'gone', kind: 'agent' }], { file: 'gone.yaml' });
    await extra.close();
    const port = /port: (\d+)/.exec(readFileSync(extra.file, 'utf8'))?.[1];
    const withGone = await start(dir, undefined, {
      file: 'with-gone.yaml',
      extraServers: [`  gone: { kind: agent, app: test, port: ${port} }`],
    });
    const run = await cli(['discover', '--deadline', '5'], withGone.file);
    expect(run.code).toBe(1);
    expect(run.stderr).toMatch(/discover failed on 1 participant/);
    expect(run.stderr).toMatch(/gone +connect ECONNREFUSED/);
    expect(run.stdout).toBe('');
  });

  test('status shows every server: phase, checkpoint, retired rollouts, readiness counts', async () => {
    const withBystander = await start(
      dir,
      [
        { name: 'env', kind: 'environment' },
        { name: 'policy', kind: 'model' },
        { name: 'plain', kind: 'agent', participates: false },
      ],
      { file: 'bystander.yaml' },
    );
    withBystander.participant('env').start('r1');
    const run = await cli(['status'], withBystander.file);
    expect(run.code).toBe(0);
    expect(run.stdout).toMatch(
      /^SERVER +KIND +PHASE +CHECKPOINT +LEASE +RETIRED +READY +BLOCKERS/m,
    );
    expect(run.stdout).toMatch(
      /^env +environment +idle +- +- +0 +no +1 +0 +episodes=1 restored=0$/m,
    );
    expect(run.stdout).toMatch(/^plain +agent +not a participant/m);

    const json = await cliJson(['status'], withBystander.file);
    const servers = json.servers as {
      server: string;
      participant: boolean;
      status?: { phase: string };
    }[];
    expect(servers.find((s) => s.server === 'env')?.status?.phase).toBe('idle');
    expect(servers.find((s) => s.server === 'plain')?.participant).toBe(false);
  });

  test('status lists the workers of a server that runs several, with their pids (idle: no readiness)', async () => {
    stack.participant('policy').statusFields = {
      workers: [
        { index: 0, pid: 4101, ready: true },
        { index: 1, pid: 4102, ready: false },
      ],
      expected_workers: 2,
      lost_workers: 0,
    };
    const run = await cli(['status']);
    expect(run.code).toBe(0);
    const workers = run.stdout.split('\n\nworkers:\n')[1] ?? '';
    expect(workers.trimEnd().split('\n')).toEqual([
      'SERVER  WORKER  PID   READY',
      'policy  0       4101  -',
      'policy  1       4102  -',
    ]);
  });

  test('status lists no workers when every server runs one process', async () => {
    stack.participant('policy').statusFields = {
      workers: [{ index: 0, pid: 4101, ready: true }],
      expected_workers: 1,
    };
    const run = await cli(['status']);
    expect(run.code).toBe(0);
    expect(run.stdout).not.toContain('workers:');
  });

  test('a stack with checkpointing off is a clear failure', async () => {
    const off = join(dir, 'off.yaml');
    const text = readFileSync(stack.file, 'utf8').replace('enabled: true', 'enabled: false');
    await import('node:fs/promises').then((fs) => fs.writeFile(off, text));
    const run = await cli(['status'], off);
    expect(run.code).toBe(1);
    expect(run.stderr).toMatch(/checkpointing is off/);
  });
});

describe('prepare, commit, resume', () => {
  test('prepare then commit the episodes in flight then resume', async () => {
    const env = stack.participant('env');
    env.start('r1');
    env.start('r2-a1');

    const prepared = await cli(['prepare', '--id', 'c1']);
    expect(prepared.code).toBe(0);
    expect(prepared.stdout).toMatch(/checkpoint c1 prepared/);
    expect(env.admissionOpen).toBe(false);

    // --id defaults to the open checkpoint; the scope to the environment's episodes.
    const committed = await cliJson(['commit', '--dir', 'ckpt']);
    expect(committed.code).toBe(0);
    expect(committed.checkpoint_id).toBe('c1');
    expect(committed.checkpoint_dir).toBe(join(dir, 'ckpt'));
    expect(committed.episode_ids).toEqual(['r1', 'r2-a1']);
    expect(committed.exported).toEqual(['r1', 'r2-a1']);
    expect(readdirSync(join(dir, 'ckpt', 'gym')).sort()).toEqual([
      'environment',
      'model',
      'resources',
    ]);
    const published = JSON.parse(readFileSync(join(dir, 'ckpt', 'controller.json'), 'utf8'));
    expect(published).toMatchObject({ checkpoint_id: 'c1', episode_ids: ['r1', 'r2-a1'] });

    const resumed = await cli(['resume']);
    expect(resumed.code).toBe(0);
    expect(resumed.stdout).toMatch(/resumed c1/);
    expect(env.admissionOpen).toBe(true);
  });

  test('commit with --episodes commits exactly those', async () => {
    const env = stack.participant('env');
    env.start('r1');
    env.start('r2');
    expect((await cli(['prepare', '--id', 'c2'])).code).toBe(0);
    const committed = await cliJson(['commit', '--id', 'c2', '--dir', 'ckpt', '--episodes', 'r2']);
    expect(committed.exported).toEqual(['r2']);
    expect((await cli(['resume', '--id', 'c2'])).code).toBe(0);
  });

  test('commit leaves out the restarts participants report', async () => {
    const env = stack.participant('env');
    env.start('r1');
    env.start('r9', 'restart');
    expect((await cli(['prepare', '--id', 'c3'])).code).toBe(0);
    const committed = await cliJson(['commit', '--dir', 'ckpt']);
    expect(committed.episode_ids).toEqual(['r1']);
    expect(committed.restarts).toEqual(['r9']);
    await cli(['resume']);
  });

  test('commit refuses to guess a scope when an environment does not list its episodes', async () => {
    const env = stack.participant('env');
    env.listsEpisodes = false;
    env.start('r1');
    expect((await cli(['prepare', '--id', 'c4'])).code).toBe(0);
    const run = await cli(['commit', '--dir', 'ckpt']);
    expect(run.code).toBe(1);
    expect(run.stderr).toMatch(/env does not list its episodes.*--episodes/);
    expect((await cli(['commit', '--dir', 'ckpt', '--episodes', 'r1'])).code).toBe(0);
    await cli(['resume']);
  });

  test('renew extends the open checkpoint’s lease', async () => {
    expect((await cli(['prepare', '--id', 'c5'])).code).toBe(0);
    const before = Date.now() / 1000;
    // Prepare's lease ends 30 s + 600 s grace from then; renewing with 300 s moves it later.
    const renewed = await cliJson(['renew', '--deadline', '300']);
    expect(renewed.code).toBe(0);
    const replies = renewed.replies as Record<string, { lease_expires_at: number }>;
    expect(Object.keys(replies).sort()).toEqual(['env', 'policy', 'tools']);
    for (const reply of Object.values(replies)) {
      expect(reply.lease_expires_at).toBeGreaterThanOrEqual(before + 900);
    }
    await cli(['resume']);
  });

  test('commit with nothing open fails and names --id', async () => {
    const run = await cli(['commit', '--dir', 'ckpt']);
    expect(run.code).toBe(1);
    expect(run.stderr).toMatch(/no checkpoint is open.*--id/);
  });

  test('resume with nothing open has nothing to do', async () => {
    const run = await cli(['resume']);
    expect(run.code).toBe(0);
    expect(run.stdout).toMatch(/nothing to resume/);
  });

  test('a refused commit prints each failing server and exits 1', async () => {
    const run = await cliJson([
      'commit',
      '--id',
      'never-prepared',
      '--dir',
      'ckpt',
      '--episodes',
      'r1',
    ]);
    expect(run.code).toBe(1);
    expect(run.ok).toBe(false);
    const error = run.error as { failures: Record<string, string> };
    expect(Object.keys(error.failures).sort()).toEqual(['env', 'policy', 'tools']);
    expect(error.failures.env).toMatch(/invalid_phase/);
  });
});

describe('a prepare that fails on a later stage', () => {
  test('prepare exits 1 naming the failing server and says the earlier stages stay closed', async () => {
    stack.participant('policy').closeError = new Error('the gate is jammed');
    const run = await cli(['prepare', '--id', 'broken']);
    expect(run.code).toBe(1);
    expect(run.stderr).toMatch(/stay closed until you resume: ckpt-gym resume --id broken/);
    expect(run.stderr).toMatch(/^policy +HTTP 409 checkpoint_error .*the gate is jammed$/m);
    expect(stack.participant('env').admissionOpen).toBe(false);
    expect((await cli(['resume', '--id', 'broken'])).code).toBe(0);
    expect(stack.participant('env').admissionOpen).toBe(true);
  });

  test('checkpoint resumes the stages it prepared before failing', async () => {
    stack.participant('policy').closeError = new Error('the gate is jammed');
    const run = await cliJson(['checkpoint', '--dir', 'ckpt', '--id', 'broken']);
    expect(run.code).toBe(1);
    expect(Object.keys((run.error as { failures: object }).failures)).toEqual(['policy']);
    expect(stack.participant('env').admissionOpen).toBe(true);
  });
});

describe('a prepare that misses its deadline', () => {
  test('prepare exits 3 with the blockers and leaves admission closed until resume', async () => {
    const env = stack.participant('env');
    env.stuck = true;
    env.start('slow');
    const run = await cli(['prepare', '--id', 'late', '--deadline', '1']);
    expect(run.code).toBe(3);
    expect(run.stdout).toMatch(/^env +environment +preparing +1: slow/m);
    expect(run.stdout).toMatch(/^policy +model +not contacted/m);
    expect(run.stdout).toMatch(/resume --id late/);
    expect(env.admissionOpen).toBe(false);

    expect((await cli(['resume'])).code).toBe(0);
    expect(env.admissionOpen).toBe(true);
  });

  test('checkpoint resumes by itself and exits 3', async () => {
    const env = stack.participant('env');
    env.stuck = true;
    env.start('slow');
    const run = await cliJson(['checkpoint', '--dir', 'ckpt', '--deadline', '1']);
    expect(run.code).toBe(3);
    expect(run.blockers).toEqual({ env: ['slow'] });
    expect(run.resumed).toBe(true);
    expect(env.admissionOpen).toBe(true);
    expect(existsSync(join(dir, 'ckpt'))).toBe(false);
  });
});

describe('checkpoint, restore, retire, forget', () => {
  test('checkpoint prepares, commits every episode in flight, resumes, and prints each stage', async () => {
    const env = stack.participant('env');
    env.start('r1');
    env.start('r2');
    env.start('r3', 'restart');
    const run = await cli(['checkpoint', '--dir', 'ckpt', '--id', 'full']);
    expect(run.code).toBe(0);
    expect(run.stdout).toMatch(/^prepare +\d+\.\d{3} s +prepared \(3 participants\)$/m);
    expect(run.stdout).toMatch(/^commit +\d+\.\d{3} s +2 episode\(s\) exported$/m);
    expect(run.stdout).toMatch(/^resume +\d+\.\d{3} s +admission open$/m);
    expect(run.stdout).toMatch(/^exported: r1,r2$/m);
    expect(run.stdout).toMatch(/^restarts .*: r3$/m);
    expect(run.stderr).toMatch(/^prepare full …$/m);
    expect(env.admissionOpen).toBe(true);
  });

  test('checkpoint --stop commits with stop and leaves the stack closed', async () => {
    const env = stack.participant('env');
    env.start('r1');
    const run = await cliJson(['checkpoint', '--dir', 'ckpt', '--stop']);
    expect(run.code).toBe(0);
    expect(run.stop).toBe(true);
    expect(run.resumed).toBe(false);
    expect(env.parkExportedCalls).toBe(1);
    expect((run.stages as { stage: string }[]).map((s) => s.stage)).toEqual(['prepare', 'commit']);
    expect(env.admissionOpen).toBe(false);
    await cli(['resume']);
  });

  test('restore into fresh servers continues the published scope; then retire and forget', async () => {
    const env = stack.participant('env');
    env.start('r1');
    env.start('r2');
    expect((await cli(['checkpoint', '--dir', 'ckpt', '--id', 'src'])).code).toBe(0);

    const fresh = await start(dir, undefined, { file: 'fresh.yaml' });
    const restored = await cliJson(['restore', '--dir', 'ckpt', '--id', 'back'], fresh.file);
    expect(restored.code).toBe(0);
    expect(restored.episode_ids).toEqual(['r1', 'r2']);
    expect(restored.restored).toEqual(['r1-a1', 'r2-a1']);
    expect([...fresh.participant('env').restored.keys()].sort()).toEqual(['r1-a1', 'r2-a1']);

    // Retire right after the restore runs under the restore's id (the open checkpoint).
    const retired = await cliJson(['retire', '--episodes', 'r2-a1'], fresh.file);
    expect(retired.code).toBe(0);
    expect(retired.checkpoint_id).toBe('back');
    expect(retired.replies).toEqual({
      env: { retired_count: 1 },
      policy: { retired_count: 1 },
      tools: { retired_count: 1 },
    });
    expect(fresh.participant('env').retired).toEqual(['r2-a1']);

    expect((await cli(['resume'], fresh.file)).code).toBe(0);
    // Restore marked r1 and r2 up to attempt 0; retire raised r2 to attempt 1.
    expect(fresh.participant('tools').marks.size).toBe(2);
    // --episodes names rollouts too: r2-a1 forgets r2.
    const forgot = await cli(['forget', '--rollouts', 'r1', '--episodes', 'r2-a1'], fresh.file);
    expect(forgot.code).toBe(0);
    expect(forgot.stdout).toMatch(/^tools +resources +2$/m);
    expect(fresh.participant('tools').marks.size).toBe(0);
  });

  test('restore without a published scope asks for --episodes', async () => {
    const run = await cli(['restore', '--dir', 'nowhere']);
    expect(run.code).toBe(1);
    expect(run.stderr).toMatch(/controller\.json.*--episodes/);
  });
});

// --- restore refuses a checkpoint it cannot trust, before anything is installed --------------

describe('restore cross-checks', () => {
  /** Checkpoint `src` of r1 and r2 (every server holds both) into ckpt, and a pristine copy. */
  async function checkpointed(): Promise<void> {
    for (const name of ['env', 'policy', 'tools']) {
      stack.participant(name).start('r1');
      stack.participant(name).start('r2');
    }
    expect((await cli(['checkpoint', '--dir', 'ckpt', '--id', 'src'])).code).toBe(0);
    cpSync(join(dir, 'ckpt'), join(dir, 'pristine'), { recursive: true });
  }

  /** A refusal of `args` into fresh servers: 422 invalid_checkpoint_state, nothing changed. */
  async function refusedIntoFresh(args: string[], detail: RegExp): Promise<TestStack> {
    const fresh = await start(dir, undefined, { file: 'fresh.yaml' });
    const run = await cli(['restore', ...args], fresh.file);
    expect(run.code).toBe(1);
    expect(run.stderr).toMatch(/invalid_checkpoint_state/);
    expect(run.stderr).toMatch(detail);
    await expectUntouched(fresh);
    // The untampered checkpoint still restores into the same servers.
    const restored = await cliJson(['restore', '--dir', 'pristine'], fresh.file);
    expect(restored.code).toBe(0);
    expect(restored.restored).toEqual(['r1-a1', 'r2-a1']);
    return fresh;
  }

  /** Every participant idle, admission open, nothing installed and no retire marks. */
  async function expectUntouched(fresh: TestStack): Promise<void> {
    const json = await cliJson(['status'], fresh.file);
    for (const row of json.servers as { status: { phase: string; retired_rollouts: number } }[]) {
      expect(row.status).toMatchObject({ phase: 'idle', retired_rollouts: 0 });
    }
    for (const participant of fresh.participants.values()) {
      expect(participant.restored.size).toBe(0);
      expect(participant.marks.size).toBe(0);
      expect(participant.retired).toEqual([]);
      expect(participant.admissionOpen).toBe(true);
    }
  }

  function rewriteController(edit: (record: Record<string, unknown>) => void): void {
    const path = join(dir, 'ckpt', 'controller.json');
    const record = JSON.parse(readFileSync(path, 'utf8')) as Record<string, unknown>;
    edit(record);
    writeFileSync(path, JSON.stringify(record));
  }

  test("the counter server's directory from a later checkpoint of the same rollouts is refused", async () => {
    await checkpointed();
    expect((await cli(['checkpoint', '--dir', 'later', '--id', 'later'])).code).toBe(0);
    const tools = join('gym', 'resources', 'tools');
    rmSync(join(dir, 'ckpt', tools), { recursive: true });
    cpSync(join(dir, 'later', tools), join(dir, 'ckpt', tools), { recursive: true });
    await refusedIntoFresh(
      ['--dir', 'ckpt'],
      /tools\/manifest\.json names checkpoint "later", but .*controller\.json names "src"/,
    );
  });

  test('controller.json that is not JSON is refused, even with --episodes', async () => {
    await checkpointed();
    writeFileSync(join(dir, 'ckpt', 'controller.json'), '{"schema_version": 1,');
    await refusedIntoFresh(['--dir', 'ckpt', '--episodes', 'r1'], /controller\.json is not JSON/);
  });

  test('controller.json with a field of the wrong type is refused', async () => {
    await checkpointed();
    rewriteController((record) => (record.episode_ids = 'r1,r2'));
    await refusedIntoFresh(['--dir', 'ckpt'], /controller\.json has no episode_ids list/);
  });

  test('controller.json naming an episode the checkpoint does not hold is refused', async () => {
    await checkpointed();
    rewriteController((record) => (record.episode_ids = ['r1', 'r2', 'r3']));
    await refusedIntoFresh(
      ['--dir', 'ckpt'],
      /1 episode\(s\) in the restore scope are not held .*: r3 \(not in .*environment\/env\/manifest\.json\);/,
    );
  });

  test('a participant holding fewer records than controller.json says is refused', async () => {
    await checkpointed();
    rewriteController((record) => (record.record_counts = { env: 2, policy: 2, tools: 3 }));
    await refusedIntoFresh(
      ['--dir', 'ckpt'],
      /tools\/manifest\.json holds 2 record\(s\), but .*controller\.json names 3 record\(s\) for tools/,
    );
  });

  test('a scope naming an episode the environment holds no record of is refused, or restarted when asked', async () => {
    await checkpointed();
    const fresh = await refusedIntoFresh(
      ['--dir', 'ckpt', '--episodes', 'r1,r2,r7'],
      /are not held by a participant that must hold them: r7 \(not in .*env\/manifest\.json\)/,
    );
    await cli(['resume'], fresh.file);
    const again = await start(dir, undefined, { file: 'again.yaml' });
    const run = await cliJson(
      ['restore', '--dir', 'ckpt', '--episodes', 'r1,r2,r7', '--restart-missing'],
      again.file,
    );
    expect(run.code).toBe(0);
    expect(run.restarts).toEqual(['r7']);
    expect(run.episode_ids).toEqual(['r1', 'r2']);
    expect(run.restored).toEqual(['r1-a1', 'r2-a1']);
    const text = await cli(
      [
        'restore',
        '--dir',
        'ckpt',
        '--episodes',
        'r1,r2,r7',
        '--restart-missing',
        '--id',
        String(run.checkpoint_id),
      ],
      again.file,
    );
    expect(text.stdout).toMatch(/^restarts .*: r7$/m);
  });

  test('a participant missing an episode it committed is refused (digest and count consistent), or restarted when asked', async () => {
    await checkpointed();
    // The model's records rewritten consistently: r2's record replaced by one of r3.
    const policy = participantDir(join(dir, 'ckpt'), 'model', 'policy');
    rmSync(policy, { recursive: true });
    await writeParticipantState({
      checkpointDir: join(dir, 'ckpt'),
      kind: 'model',
      instance: 'policy',
      checkpointId: 'src',
      records: ['r1', 'r3'].map((r) => ({
        episode_id: { rollout_id: r, attempt: 0 },
        payload: `policy:${r}`,
      })),
    });
    const fresh = await refusedIntoFresh(
      ['--dir', 'ckpt'],
      /1 episode\(s\) in the restore scope are not held .*: r2 \(not in .*model\/policy\/manifest\.json\)/,
    );
    await cli(['resume'], fresh.file);
    const again = await start(dir, undefined, { file: 'again.yaml' });
    const run = await cliJson(['restore', '--dir', 'ckpt', '--restart-missing'], again.file);
    expect(run.code).toBe(0);
    expect(run.restarts).toEqual(['r2']);
    expect(run.restored).toEqual(['r1-a1']);
  });

  test('a refused restore retires nothing: no marks, nothing installed, on any participant', async () => {
    await checkpointed();
    const policy = join(dir, 'ckpt', 'gym', 'model', 'policy');
    const records = readdirSync(policy).find((name) => name.startsWith('records'));
    // Forged at the same size, so it is the digest that refuses it, not the declared byte size.
    const path = join(policy, records as string);
    const size = readFileSync(path).length;
    const forged = `${JSON.stringify({ episode_id: { rollout_id: 'r1', attempt: 0 }, payload: '' })}`;
    writeFileSync(path, `${forged.slice(0, -2)}${'x'.repeat(size - forged.length - 1)}"}\n`);
    expect(readFileSync(path).length).toBe(size);
    await refusedIntoFresh(['--dir', 'ckpt'], /policy.* does not match its manifest digest/);
  });
});
