/**
 * A worker's pushed reports are the coordinator's only news of it between the close reply and the
 * commit: none may be lost while the link is up, or the checkpoint waits on that worker forever.
 */
import { captureKey, episodeId } from '../../src/identity.js';
import { reportRetryDelayMs } from '../../src/workers/rules.js';
import { now, startToy, type Toy } from './toy.js';
import { useSockets } from './sockets.js';

useSockets();

const prepare = (id: string, seconds: number) => ({
  checkpoint_id: id,
  deadline_ts: now() + seconds,
});
const r1 = episodeId('r1', 0);

/** The coordinator refuses the next `count` pushed reports (the push fails, the link stays up). */
function failReports(toy: Toy, count: number): { failed: number } {
  const seen = { failed: 0 };
  const receive = toy.coordinator.receiveReport.bind(toy.coordinator);
  toy.coordinator.receiveReport = (...args) => {
    if (seen.failed < count) {
      seen.failed += 1;
      throw new Error('the report was lost');
    }
    receive(...args);
  };
  return seen;
}

describe('worker reports: a failed push is sent again while the link is up', () => {
  test('a worker that joins during a checkpoint and whose reports fail is not left unreported', async () => {
    const toy = await startToy(2);
    await toy.worker(1);
    const first = await toy.plane.prepare(prepare('c1', 0.3));
    expect(first.report.blockers).toContain('resources-workers-unreported:1');
    const failed = failReports(toy, 2);
    // It joins while admission is closed: its pushed reports are its only reports.
    await toy.worker(2);
    expect((await toy.plane.prepare(prepare('c1', 20))).phase).toBe('prepared');
    expect(failed.failed).toBe(2);
    const warnings = toy.logger.lines.filter((l) => l.message.startsWith('could not report'));
    // Once per run of failures, not once per attempt.
    expect(warnings.map((l) => [l.level, l.message])).toEqual([
      ['warn', 'could not report to the toy checkpoint coordinator; sending it again'],
    ]);
  });

  test('a busy close reply followed by a failed push: ready once the work ends', async () => {
    const toy = await startToy(1);
    const one = await toy.worker(1);
    const ticket = one.side.gate.enter({ episode: r1 });
    const first = await toy.plane.prepare(prepare('c1', 0.3));
    expect([first.phase, first.report.blockers]).toEqual(['preparing', [captureKey(r1)]]);
    const failed = failReports(toy, 1);
    one.side.gate.leave(ticket);
    expect((await toy.plane.prepare(prepare('c1', 20))).phase).toBe('prepared');
    expect(failed.failed).toBe(1);
  });

  test('the pause before a report is sent again doubles from 50 ms, to at most 1 s', () => {
    expect([1, 2, 3, 4, 5, 6, 20].map(reportRetryDelayMs)).toEqual([
      50, 100, 200, 400, 800, 1000, 1000,
    ]);
  });
});
