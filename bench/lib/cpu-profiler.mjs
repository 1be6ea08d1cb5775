/* global process */
// Preloaded into each server by `throughput --profile` (NODE_OPTIONS=--import <this file>): node's
// `--cpu-prof` by hand, for two reasons: node 20 refuses `--cpu-prof` in NODE_OPTIONS (and the
// launcher's node flags are the same for every run), and `--cpu-prof` profiles the whole process
// (start-up, schema compiles, the warm-up), which drowns the timed run. Here V8's sampling
// profiler runs from one SIGUSR2 to the next (the bench signals around its timed rollouts) and
// writes `<pid>.cpuprofile`, the format `--cpu-prof` writes, into CKPT_GYM_CPU_PROF_DIR; a process
// that exits while profiling writes it then (the in-process inspector session answers
// synchronously, so the 'exit' handler can).
import { writeFileSync } from 'node:fs';
import { Session } from 'node:inspector';
import { join } from 'node:path';

const dir = process.env.CKPT_GYM_CPU_PROF_DIR;
if (dir) {
  const session = new Session();
  session.connect();
  session.post('Profiler.enable');
  // --cpu-prof's default interval: one sample per ms.
  session.post('Profiler.setSamplingInterval', { interval: 1000 });
  let profiling = false;
  const stop = () => {
    if (!profiling) return;
    profiling = false;
    session.post('Profiler.stop', (err, result) => {
      if (!err)
        writeFileSync(join(dir, `${process.pid}.cpuprofile`), JSON.stringify(result.profile));
    });
  };
  process.on('SIGUSR2', () => {
    if (profiling) stop();
    else {
      profiling = true;
      session.post('Profiler.start');
    }
  });
  process.on('exit', stop);
}
