/**
 * The CLI's exit codes: a stable contract for scripts and controllers, documented in the README.
 */
export const ExitCode = {
  OK: 0,
  /** The work failed: a participant refused or was unreachable, a bad stack file, … */
  FAILURE: 1,
  /** The command line was wrong; the usage goes to stderr. */
  USAGE: 2,
  /** A prepare missed its deadline: some participant was not ready (it stays closed until resumed). */
  NOT_PREPARED: 3,
  /** A collection stopped after a checkpoint (sysexits' EX_TEMPFAIL: run it again to continue); `run` uses it. */
  COLLECTION_STOPPED: 75,
} as const;

export type ExitCodeValue = (typeof ExitCode)[keyof typeof ExitCode];
