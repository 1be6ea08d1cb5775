/* global process, URL */
// CPU profiles of a stack's servers over the timed rollouts (V8's sampling profiler through
// ./cpu-profiler.mjs): where each server's time goes, as its top functions by self time.
import { readdirSync, readFileSync, renameSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

const PROFILER = fileURLToPath(new URL('./cpu-profiler.mjs', import.meta.url));

/** The environment that makes each server write its CPU profile into `dir` on exit. */
export function cpuProfileEnv(dir, env = process.env) {
  const flags = `--import ${PROFILER}`;
  return {
    NODE_OPTIONS: env.NODE_OPTIONS ? `${env.NODE_OPTIONS} ${flags}` : flags,
    CKPT_GYM_CPU_PROF_DIR: dir,
  };
}

/** Starts (first call) or stops and writes (second call) the profile of every server. */
export function toggleProfiles(handle) {
  toggleProfilesOf(handle.servers.values());
}

/** As `toggleProfiles`, for these processes (`{ pid }`s: a policy worker too). */
export function toggleProfilesOf(processes) {
  for (const { pid } of processes) process.kill(pid, 'SIGUSR2');
}

/** `file:///…/node_modules/x/y.js` → `x/y.js`, a repo file relative to the repo, node's as is. */
function shortUrl(url, repo) {
  const path = url.replace(/^file:\/\//, '');
  const inModules = path.lastIndexOf('/node_modules/');
  if (inModules >= 0) return path.slice(inModules + '/node_modules/'.length);
  return path.startsWith(`${repo}/`) ? path.slice(repo.length + 1) : path;
}

/**
 * The `top` functions by self time of one .cpuprofile, with the busy time (all samples but
 * `(idle)`) they are a share of. A sample's time is the delta to the next sample.
 */
export function topSelfTime(profile, repo, top = 10) {
  const nodes = new Map(profile.nodes.map((node) => [node.id, node.callFrame]));
  const selfUs = new Map();
  const { samples, timeDeltas } = profile;
  for (let i = 0; i < samples.length; i++) {
    const frame = nodes.get(samples[i]);
    const name = frame.functionName || '(anonymous)';
    const key = frame.url ? `${name} ${shortUrl(frame.url, repo)}:${frame.lineNumber + 1}` : name;
    selfUs.set(key, (selfUs.get(key) ?? 0) + (timeDeltas[i + 1] ?? 0));
  }
  selfUs.delete('(idle)');
  const busyUs = [...selfUs.values()].reduce((a, b) => a + b, 0);
  const functions = [...selfUs]
    .sort((a, b) => b[1] - a[1])
    .slice(0, top)
    .map(([fn, us]) => ({ fn, self_ms: us / 1000, share: us / busyUs }));
  return { busy_ms: busyUs / 1000, functions };
}

/**
 * Names each server's profile in `dir` `<server>.cpuprofile` (written as `<pid>.cpuprofile`) and
 * returns each one's top functions.
 */
export function serverProfiles(handle, dir, repo) {
  const byPid = new Map([...handle.servers.values()].map((s) => [s.pid, s.name]));
  const profiles = {};
  for (const file of readdirSync(dir).filter((f) => /^\d+\.cpuprofile$/.test(f))) {
    const pid = Number(file.split('.')[0]);
    const name = byPid.get(pid);
    if (name === undefined) continue;
    const path = join(dir, `${name}.cpuprofile`);
    renameSync(join(dir, file), path);
    profiles[name] = { file: path, ...topSelfTime(JSON.parse(readFileSync(path, 'utf8')), repo) };
  }
  return profiles;
}
