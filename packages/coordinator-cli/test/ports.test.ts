import { readFileSync } from 'node:fs';

import { freePort, SERVER_PORT_FLOOR } from '../src/launcher.js';

describe('freePort', () => {
  test('server ports come from below the ephemeral range, where no outgoing connection can take them first', async () => {
    const ephemeralLow = Number(
      readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/)[0],
    );
    const ports = await Promise.all(Array.from({ length: 20 }, () => freePort('127.0.0.1')));
    for (const port of ports) {
      expect(port).toBeGreaterThanOrEqual(SERVER_PORT_FLOOR);
      expect(port).toBeLessThan(ephemeralLow);
    }
  });

  test('never hands out the same port twice in one process', async () => {
    const ports = [];
    for (let i = 0; i < 500; i++) ports.push(await freePort('127.0.0.1'));
    expect(new Set(ports).size).toBe(ports.length);
  });
});
