import { readFileSync } from 'node:fs';

/**
 * Whether the kernel has a TCP keep-alive timer on the IPv4 connection from `localPort` to
 * `remotePort` on this host (`/proc/net/tcp`, Linux only); undefined when no such connection is
 * listed. A test reads a live connection's probing here, not in the options it was given.
 */
export function tcpKeepAliveTimerOn(localPort: number, remotePort: number): boolean | undefined {
  const hex = (port: number) => `:${port.toString(16).toUpperCase().padStart(4, '0')}`;
  for (const line of readFileSync('/proc/net/tcp', 'utf8').split('\n').slice(1)) {
    const [, local, remote, , , timer] = line.trim().split(/\s+/);
    if (local?.endsWith(hex(localPort)) && remote?.endsWith(hex(remotePort))) {
      return timer?.startsWith(`${KEEP_ALIVE_TIMER}:`);
    }
  }
  return undefined;
}

/** The kernel's code for a keep-alive timer in `/proc/net/tcp`'s `tr` column. */
const KEEP_ALIVE_TIMER = '02';
