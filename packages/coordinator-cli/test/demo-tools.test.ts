/**
 * `demo --tools`: the option, the stack it writes, what counts as a repeated model call, and the
 * demo run with its tools over MCP (spawned processes, a real crash and restore).
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { parse } from 'yaml';

import {
  type DemoReport,
  demoStackText,
  ExitCode,
  parseCommandLine,
  repeatedCalls,
} from '../src/index.js';
import { ensureBuilt } from './support/build.js';
import { cli } from './support/cli.js';

beforeAll(() => ensureBuilt(), 300_000);

type Servers = Record<string, Record<string, unknown>>;

function servers(tools?: 'direct_http' | 'mcp'): Servers {
  return (parse(demoStackText(4000, 'tok', tools)) as { servers: Servers }).servers;
}

test('demo --tools takes direct_http or mcp, direct_http by default', () => {
  const invocation = (argv: string[]) => {
    const parsed = parseCommandLine(argv);
    if (parsed.kind !== 'invoke') throw new Error(JSON.stringify(parsed));
    return parsed.invocation;
  };
  expect(invocation(['demo']).demoTools).toBe('direct_http');
  expect(invocation(['demo', '--tools', 'mcp']).demoTools).toBe('mcp');
  const bad = parseCommandLine(['demo', '--tools', 'sse']);
  expect(bad).toMatchObject({ kind: 'usage-error' });
  expect(bad.kind === 'usage-error' && bad.message).toMatch(/--tools must be direct_http or mcp/);
});

test('the mcp demo stack exposes MCP tools, grants them and has the agents take them', () => {
  const mcp = servers('mcp');
  for (const name of ['weather', 'counter']) expect(mcp[name]!.expose_tools_over_mcp).toBe(true);
  for (const name of ['simple_agent', 'counter_agent'])
    expect(mcp[name]!.tool_transport).toBe('mcp');
  for (const name of ['env', 'counter_env'])
    expect(mcp[name]!.resources_tool_transports).toEqual(['mcp']);
  // The default stack is the direct HTTP one, unchanged.
  const direct = servers();
  expect(Object.values(direct).some((s) => 'expose_tools_over_mcp' in s)).toBe(false);
  expect(Object.values(direct).some((s) => 'tool_transport' in s)).toBe(false);
  expect(Object.values(direct).some((s) => 'resources_tool_transports' in s)).toBe(false);
});

test('a rollout that started over may make its calls again; a continued one may not', () => {
  const call = { rollout_id: 'r', n_messages: 2, held: false, returned: true, dropped: false };
  const other = { ...call, rollout_id: 'q' };
  const log = [call, call, other, other];
  expect(repeatedCalls(log)).toBe(2);
  expect(repeatedCalls(log, new Set(['r']))).toBe(1);
  expect(repeatedCalls(log, new Set(['r', 'q']))).toBe(0);
});

test('demo --tools mcp: every rollout in flight at the crash starts over and finishes once with reward 1', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'ckpt-gym-demo-mcp-test-'));
  try {
    const run = await cli(['demo', '--tools', 'mcp', '--rollouts', '4', '--json'], dir);
    const report = run.json() as unknown as DemoReport & { exit_code: number };
    expect(report).toMatchObject({
      exit_code: ExitCode.OK,
      ok: true,
      tools: 'mcp',
      rollouts: 4,
      finished_before_checkpoint: 1,
      // An episode that grants MCP access is a restart: none is continued.
      continued: 0,
      restarted: 3,
      repeated_model_calls: 0,
      not_exactly_once: [],
      rewards: { '1': 4 },
    });
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}, 180_000);
