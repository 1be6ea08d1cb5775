import { IdleQueue } from '../src/idle-queue.js';

/** One event-loop turn (setImmediate callbacks queued before this one run first). */
const turn = () => new Promise<void>((resolve) => setImmediate(resolve));

describe('IdleQueue', () => {
  test('work runs in idle turns, a slice per turn, never during the call that queues', async () => {
    const done: number[] = [];
    const queue = new IdleQueue<number>((n) => void done.push(n), { slice: 3 });
    for (let i = 0; i < 7; i++) queue.add(i);
    expect(done).toEqual([]);
    await turn();
    expect(done).toEqual([0, 1, 2]);
    await turn();
    expect(done).toEqual([0, 1, 2, 3, 4, 5]);
    await turn();
    expect(done).toEqual([0, 1, 2, 3, 4, 5, 6]);
    expect(queue.size).toBe(0);
  });

  test('an item queued twice runs once, and a deleted one not at all', async () => {
    const done: string[] = [];
    const queue = new IdleQueue<string>((s) => void done.push(s));
    queue.add('a');
    queue.add('b');
    queue.add('a');
    queue.delete('b');
    await turn();
    expect(done).toEqual(['a']);
  });

  test('an item whose work throws does not stop the others', async () => {
    const done: number[] = [];
    const queue = new IdleQueue<number>((n) => {
      if (n === 1) throw new Error('not JSON');
      done.push(n);
    });
    [0, 1, 2].forEach((n) => queue.add(n));
    await turn();
    expect(done).toEqual([0, 2]);
  });

  test('asynchronous work that rejects is ignored, and the slice goes on', async () => {
    const done: number[] = [];
    const queue = new IdleQueue<number>(async (n) => {
      if (n === 0) throw new Error('gone');
      done.push(n);
    });
    [0, 1].forEach((n) => queue.add(n));
    await turn();
    await turn();
    expect(done).toEqual([1]);
  });

  test('items queued after the queue drained are run in a later turn', async () => {
    const done: number[] = [];
    const queue = new IdleQueue<number>((n) => void done.push(n));
    queue.add(1);
    await turn();
    queue.add(2);
    await turn();
    expect(done).toEqual([1, 2]);
  });

  test('an item waits its settle time before it is worked, and one deleted before then never is', async () => {
    const done: number[] = [];
    const queue = new IdleQueue<number>((n) => void done.push(n), { settleMs: 40 });
    queue.add(1);
    queue.add(2);
    await turn();
    await turn();
    expect(done).toEqual([]);
    queue.delete(2);
    await new Promise((resolve) => setTimeout(resolve, 120));
    expect(done).toEqual([1]);
    expect(queue.size).toBe(0);
  });

  test('a slice works only the settled items: one queued later waits out its own settle time', async () => {
    const done: number[] = [];
    let firstWorked!: () => void;
    const worked = new Promise<void>((resolve) => (firstWorked = resolve));
    const queue = new IdleQueue<number>(
      (n) => {
        done.push(n);
        if (n === 1) firstWorked();
      },
      { settleMs: 40 },
    );
    queue.add(1);
    await new Promise((resolve) => setTimeout(resolve, 20));
    queue.add(2);
    await worked;
    await turn();
    expect(done).toEqual([1]);
    await new Promise((resolve) => setTimeout(resolve, 120));
    expect(done).toEqual([1, 2]);
  });

  test('while urgent, items are worked in the next idle turn; hurry works the settling ones at once', async () => {
    const done: number[] = [];
    let urgent = false;
    const queue = new IdleQueue<number>((n) => void done.push(n), {
      settleMs: 60_000,
      urgent: () => urgent,
    });
    queue.add(1);
    await turn();
    expect(done).toEqual([]);
    queue.hurry();
    await turn();
    expect(done).toEqual([1]);
    urgent = true;
    queue.add(2);
    await turn();
    expect(done).toEqual([1, 2]);
  });
});
