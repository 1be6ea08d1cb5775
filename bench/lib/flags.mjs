// What the benchmarks share for their flags and their child processes.

/** Flag `name` as an integer of at least `least`. */
export function integerFlag(flags, name, least) {
  const value = Number(flags[name]);
  if (!Number.isSafeInteger(value) || value < least)
    throw new Error(`--${name} must be ≥ ${least}`);
  return value;
}

/** The next message a forked child sends. */
export function nextMessage(child) {
  return new Promise((done) => child.once('message', done));
}
