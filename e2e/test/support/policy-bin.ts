/**
 * A policy model server with several workers, run by its own bin (`ckpt-gym-policy-model`: core's
 * server entry, whose primary process runs the coordinator and forks the workers) beside the
 * servers the CLI's launcher runs. `withPolicyBin` wraps the launcher's handle so its server list,
 * crash (SIGKILL of the whole process group, workers included), restart and stop cover it too.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { closeSync, openSync } from 'node:fs';
import { mkdir, readdir, readFile } from 'node:fs/promises';
import { join, resolve } from 'node:path';

import type { LaunchedServer, StackHandle } from '@ckpt-gym/coordinator-cli';
import { until } from '@ckpt-gym/testing';

export const POLICY_BIN = resolve(
  import.meta.dirname,
  '../../../packages/policy-model-server/bin/ckpt-gym-policy-model.js',
);

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

function killGroup(pid: number): void {
  try {
    process.kill(-pid, 'SIGKILL');
  } catch {
    // Already gone.
  }
}

/** The pids of the processes whose parent is `pid` (a primary's forked workers). */
export async function childPids(pid: number): Promise<number[]> {
  const children: number[] = [];
  for (const entry of await readdir('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      const stat = await readFile(`/proc/${entry}/stat`, 'utf8');
      // pid (comm) state ppid …: comm may hold spaces, so read after its closing parenthesis.
      const ppid = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
      if (ppid === pid) children.push(Number(entry));
    } catch {
      // The process ended meanwhile.
    }
  }
  return children.sort((a, b) => a - b);
}

class PolicyBinServer {
  server: LaunchedServer;
  #child: ChildProcess | undefined;

  constructor(
    readonly name: string,
    readonly url: string,
    readonly port: number,
    readonly logPath: string,
  ) {
    this.server = { name, kind: 'model', pid: 0, port, url, logPath };
  }

  /** Spawns the bin in its own process group; resolves once every worker answers health. */
  async start(configPath: string, cwd: string): Promise<void> {
    await mkdir(join(cwd, 'logs'), { recursive: true });
    const log = openSync(this.logPath, 'a');
    try {
      this.#child = spawn(
        process.execPath,
        [POLICY_BIN, '--config', configPath, '--server', this.name],
        { detached: true, stdio: ['ignore', log, log], cwd },
      );
    } finally {
      closeSync(log);
    }
    const child = this.#child;
    this.server = { ...this.server, pid: child.pid! };
    await until(
      async () => {
        if (child.exitCode !== null) throw new Error(`${this.name} exited: see ${this.logPath}`);
        return (await readFile(this.logPath, 'utf8')).includes(
          `"event":"listening","server":"${this.name}"`,
        );
      },
      `${this.name} to listen`,
      60_000,
    );
  }

  running(): boolean {
    return this.server.pid !== 0 && alive(this.server.pid);
  }

  async kill(): Promise<void> {
    const pid = this.server.pid;
    if (pid === 0) return;
    killGroup(pid);
    await until(async () => !alive(-pid) && !alive(pid), `${this.name} to die`, 30_000);
  }
}

/**
 * The launcher's `handle` (started without the server `name`), with `name` run by its bin from
 * the same resolved stack file.
 */
export async function withPolicyBin(
  handle: StackHandle,
  name: string,
  port: number,
): Promise<StackHandle> {
  const url = `http://127.0.0.1:${port}`;
  const bin = new PolicyBinServer(name, url, port, join(handle.runDir, 'logs', `${name}.log`));
  await bin.start(handle.configPath, handle.runDir);
  const servers = handle.servers;
  const list = () => new Map([...servers, [name, bin.server]]);
  return {
    runDir: handle.runDir,
    configPath: handle.configPath,
    get servers() {
      return list();
    },
    startServer: (server) => handle.startServer(server),
    async crash(opts) {
      await Promise.all([handle.crash(opts), bin.kill()]);
    },
    async stop(opts) {
      await Promise.all([handle.stop(opts), bin.kill()]);
    },
    async restart() {
      if (!bin.running()) await bin.start(handle.configPath, handle.runDir);
      await handle.restart();
    },
  };
}

/** The servers of a generated stack text (one `  name: { … port: N … }` line each), by name. */
export function serverPorts(text: string): Map<string, number> {
  const ports = new Map<string, number>();
  for (const m of text.matchAll(/^ {2}([A-Za-z0-9][A-Za-z0-9._-]*): \{.* port: (\d+)/gm)) {
    ports.set(m[1]!, Number(m[2]));
  }
  return ports;
}
