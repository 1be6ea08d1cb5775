import { Lease } from '../../src/control/lease.js';
import { FakeClock } from '../support/fake-clock.js';

const GRACE = 60;

function lease(): { clock: FakeClock; lease: Lease; expiries: () => number } {
  const clock = new FakeClock();
  let count = 0;
  const made = new Lease(clock, GRACE, () => {
    count += 1;
  });
  return { clock, lease: made, expiries: () => count };
}

describe('lease', () => {
  test('has no expiry and no timer before its first renewal', () => {
    const { clock, lease: l } = lease();
    expect(l.expiresAt).toBeNull();
    expect(l.isExpired()).toBe(false);
    expect(clock.pendingTimers).toBe(0);
  });

  test('a renewal extends it to the deadline plus the grace, never earlier', () => {
    const { clock, lease: l } = lease();
    const now = clock.now();
    expect(l.renew(now + 10)).toBe(now + 10 + GRACE);
    expect(l.renew(now + 500)).toBe(now + 500 + GRACE);
    expect(l.renew(now + 1)).toBe(now + 500 + GRACE);
    expect(l.expiresAt).toBe(now + 500 + GRACE);
  });

  test('the expiry callback fires once, when the clock reaches the expiry', () => {
    const { clock, lease: l, expiries } = lease();
    l.renew(clock.now() + 10);
    clock.advance(10 + GRACE - 1);
    expect(expiries()).toBe(0);
    expect(l.isExpired()).toBe(false);
    clock.advance(1);
    expect(expiries()).toBe(1);
    expect(l.isExpired()).toBe(true);
    clock.advance(10_000);
    expect(expiries()).toBe(1);
    expect(clock.pendingTimers).toBe(0);
  });

  test('a renewal moves the timer: the earlier expiry time passes without a callback', () => {
    const { clock, lease: l, expiries } = lease();
    l.renew(clock.now() + 10);
    l.renew(clock.now() + 100);
    expect(clock.pendingTimers).toBe(1);
    clock.advance(10 + GRACE + 1);
    expect(expiries()).toBe(0);
    clock.advance(100 - 10 - 1);
    expect(expiries()).toBe(1);
  });

  test('isExpired when the wall clock went back before the check re-arms the timer', () => {
    const fake = new FakeClock();
    let stepBack = 0;
    const clock = { now: () => fake.now() - stepBack, setTimeout: fake.setTimeout.bind(fake) };
    let count = 0;
    const l = new Lease(clock, GRACE, () => {
      count += 1;
    });
    l.renew(clock.now() + 10);
    fake.advance(10 + GRACE);
    expect(count).toBe(1);
    stepBack = 5;
    expect(l.isExpired()).toBe(false);
    expect(fake.pendingTimers).toBe(1);
    fake.advance(5);
    expect(count).toBe(2);
    expect(l.isExpired()).toBe(true);
  });

  test('retryIn fires the callback again after the given seconds', () => {
    const { clock, lease: l, expiries } = lease();
    l.renew(clock.now() + 10);
    clock.advance(10 + GRACE);
    expect(expiries()).toBe(1);
    l.retryIn(30);
    clock.advance(29);
    expect(expiries()).toBe(1);
    clock.advance(1);
    expect(expiries()).toBe(2);
    expect(l.isExpired()).toBe(true);
  });

  test('end cancels the timer for good: no callback, no timer, even after a renewal', () => {
    const { clock, lease: l, expiries } = lease();
    l.renew(clock.now() + 10);
    l.end();
    expect(clock.pendingTimers).toBe(0);
    l.renew(clock.now() + 20);
    l.retryIn(5);
    expect(clock.pendingTimers).toBe(0);
    clock.advance(10_000);
    expect(expiries()).toBe(0);
    expect(l.isExpired()).toBe(false);
  });
});
