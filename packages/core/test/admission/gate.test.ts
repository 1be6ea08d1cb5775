import { AdmissionClosedError } from '../../src/errors.js';
import { AdmissionGate, type GateRule, type GateSnapshot } from '../../src/admission/gate.js';
import { ADMIT, modelCallAdmission, refuse, WAIT } from '../../src/admission/rules.js';

const r = (attempt = 0) => ({ rollout_id: 'r', attempt });
/** Admitted while open, waits while closed. */
const openRule: GateRule = (g) => (g.open ? ADMIT : WAIT);

/** Whether `promise` settled once the pending turns ran. */
function settled(promise: Promise<unknown>): Promise<boolean> {
  const done = promise.then(
    () => true,
    () => true,
  );
  return Promise.race([done, new Promise<boolean>((resolve) => setImmediate(resolve, false))]);
}

describe('AdmissionGate', () => {
  test('a request waits while its rule says wait, counted as waiting and not in flight', async () => {
    const gate = new AdmissionGate();
    gate.close();
    const waiting = gate.admit({ episode: r(), rule: openRule });
    expect(await settled(waiting)).toBe(false);
    expect(gate.snapshot()).toMatchObject({ open: false, inFlight: 0, waiting: 1 });
    gate.open();
    const ticket = await waiting;
    expect(gate.snapshot()).toMatchObject({ inFlight: 1, waiting: 0, byKey: { r: 1 } });
    gate.leave(ticket);
    gate.leave(ticket);
    expect(gate.inFlight).toBe(0);
  });

  test("a waiting request leaves with its signal's reason when the signal aborts", async () => {
    const gate = new AdmissionGate();
    gate.close();
    const controller = new AbortController();
    const waiting = gate.admit({ rule: openRule, signal: controller.signal });
    expect(await settled(waiting)).toBe(false);
    expect(gate.waitingUntagged).toBe(1);
    controller.abort(new Error('client disconnected'));
    await expect(waiting).rejects.toThrow('client disconnected');
    expect(gate.waiting).toBe(0);
  });

  test('a refusal is thrown and enters nothing', async () => {
    const gate = new AdmissionGate();
    const error = new AdmissionClosedError('no');
    await expect(gate.admit({ episode: r(), rule: () => refuse(error) })).rejects.toBe(error);
    expect(gate.snapshot()).toMatchObject({ inFlight: 0, served: false });
  });

  test('refuseWaiting refuses the covered waiters for good and resolves once they left', async () => {
    const gate = new AdmissionGate();
    gate.close();
    const rule =
      (attempt: number): GateRule =>
      (g) =>
        modelCallAdmission({ ...g, key: `r-a${attempt}`, retired: g.refused });
    const covered = gate.admit({ episode: r(1), rule: rule(1) });
    const later = gate.admit({ episode: r(2), rule: rule(2) });
    await settled(covered);
    await gate.refuseWaiting([r(1)]);
    await expect(covered).rejects.toMatchObject({ code: 'stale_attempt' });
    expect(await settled(later)).toBe(false);
    gate.open();
    gate.leave(await later);
  });

  test('retire aborts the covered tickets once and waits for them to leave; drain only waits', async () => {
    const gate = new AdmissionGate();
    const call = gate.enter({ episode: r(1), tag: 'call' });
    const seed = gate.enter({ episode: r(0), tag: 'seed' });
    const later = gate.enter({ episode: r(2), tag: 'call' });
    const untagged = gate.enter({ tag: 'call' });
    let aborts = 0;
    call.signal.addEventListener('abort', () => (aborts += 1));
    const first = gate.retire(r(1), 'call');
    const again = gate.retire(r(1), 'call');
    const drained = gate.drain(r(1), 'seed');
    expect(aborts).toBe(1);
    expect(call.signal.reason).toMatchObject({ code: 'stale_attempt' });
    expect(seed.signal.aborted).toBe(false);
    expect(later.signal.aborted || untagged.signal.aborted).toBe(false);
    expect(await settled(first)).toBe(false);
    gate.leave(call);
    await Promise.all([first, again]);
    expect(await settled(drained)).toBe(false);
    gate.leave(seed);
    await drained;
    expect(aborts).toBe(1);
    expect(gate.holds(r(1))).toBe(false);
    expect(gate.holds(r(2), 'call')).toBe(true);
  });

  test('a ticket retired before anyone read its signal still reads aborted, with the retire reason, and its left resolves', async () => {
    const gate = new AdmissionGate();
    const ticket = gate.enter({ episode: r(1), tag: 'call' });
    const retired = gate.retire(r(1));
    expect(ticket.signal.aborted).toBe(true);
    expect(ticket.signal.reason).toMatchObject({ code: 'stale_attempt' });
    gate.abort(ticket, new Error('a second abort'));
    expect(ticket.signal.reason).toMatchObject({ code: 'stale_attempt' });
    gate.leave(ticket);
    await retired;
    expect(await settled(ticket.left)).toBe(true);
    // A ticket whose left is first read after it left: already resolved.
    const quiet = gate.enter({ episode: r(2) });
    gate.leave(quiet);
    expect(await settled(quiet.left)).toBe(true);
    expect(quiet.left).toBe(quiet.left);
  });

  test('until waits for a predicate, checked again as tickets leave', async () => {
    const gate = new AdmissionGate();
    const ticket = gate.enter({ episode: r() });
    const drained = gate.until(() => gate.count() === 0);
    expect(await settled(drained)).toBe(false);
    gate.leave(ticket);
    await drained;
  });

  test('the snapshot is plain JSON: it round-trips unchanged, and onChange says when it changed', async () => {
    const gate = new AdmissionGate();
    let changes = 0;
    const stop = gate.onChange(() => (changes += 1));
    gate.enter({ episode: r(), tag: 'seed' });
    gate.enter({ episode: r(3), tag: 'call' });
    gate.enter({ tag: 'call' });
    gate.close();
    const waiting = gate.admit({ episode: r(4), rule: openRule });
    await settled(waiting);
    const snapshot = gate.snapshot();
    const copy = JSON.parse(JSON.stringify(snapshot)) as GateSnapshot;
    expect(copy).toEqual(snapshot);
    expect(copy).toEqual({
      open: false,
      served: true,
      inFlight: 3,
      waiting: 1,
      waitingUntagged: 0,
      byKey: { r: 1, 'r-a3': 1, '': 1 },
      byTag: { seed: 1, call: 2 },
    });
    expect(changes).toBe(5);
    stop();
    gate.open();
    await waiting;
    expect(changes).toBe(5);
  });
});
