import { deadline, Gate, until, UntilTimeoutError } from '../src/index.js';

describe('until', () => {
  test('resolves as soon as the check holds, sync or async', async () => {
    let n = 0;
    await until(() => ++n >= 3, 'three checks');
    expect(n).toBe(3);
    await until(async () => true, 'an async check');
  });

  test('gives up after its timeout with a message naming what it waited for', async () => {
    const waited = until(() => false, 'the agent to park', 20);
    await expect(waited).rejects.toThrow(UntilTimeoutError);
    await expect(waited).rejects.toThrow('timed out after 20 ms waiting for the agent to park');
  });

  test('a check that throws fails the wait with its own error', async () => {
    const failing = () => {
      throw new Error('status route gone');
    };
    await expect(until(failing, 'status')).rejects.toThrow('status route gone');
  });
});

describe('Gate', () => {
  test('holds until opened, and says so', async () => {
    const gate = new Gate();
    let passed = false;
    const held = gate.promise.then(() => (passed = true));
    await new Promise((r) => setImmediate(r));
    expect(passed).toBe(false);
    expect(gate.settled).toBe(false);
    const { open } = gate; // handed on as a callback, as stubs do
    open();
    await held;
    expect(passed).toBe(true);
    expect(gate.settled).toBe(true);
  });

  test('a failed gate rejects its waiters, and an unawaited one is no unhandled rejection', async () => {
    const gate = new Gate();
    gate.fail(new Error('export broke'));
    expect(gate.settled).toBe(true);
    await expect(gate.promise).rejects.toThrow('export broke');
    new Gate().fail(new Error('nobody waits'));
    await new Promise((r) => setImmediate(r));
  });
});

test('deadline is epoch seconds from now', () => {
  const now = Date.now() / 1000;
  const at = deadline(30);
  expect(at).toBeGreaterThanOrEqual(now + 30);
  expect(at).toBeLessThan(now + 31);
});
