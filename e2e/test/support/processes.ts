/** What the e2e suite reads of real processes: a primary's forked workers, from `/proc`. */
import { readdir, readFile } from 'node:fs/promises';

/** The pids of the processes whose parent is `pid` (a primary's forked workers), ascending. */
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
