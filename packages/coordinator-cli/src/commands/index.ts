/** The handler of every command in the table of args.ts (the compiler checks none is missing). */
import type { CommandName } from '../args.js';
import type { CommandContext } from '../context.js';
import type { CommandResult } from '../output.js';
import { checkpointCommand } from './checkpoint.js';
import { checkpointNowCommand } from './checkpoint-now.js';
import { commitCommand } from './commit.js';
import { demoCommand } from './demo.js';
import { discoverCommand } from './discover.js';
import { prepareCommand } from './prepare.js';
import { renewCommand } from './renew.js';
import { restoreCommand } from './restore.js';
import { resumeCommand } from './resume.js';
import { forgetCommand, retireCommand } from './retire.js';
import { runCommand } from './run.js';
import { crashCommand, downCommand, serveCommand, upCommand } from './stack.js';
import { statusCommand } from './status.js';

export type CommandHandler = (ctx: CommandContext) => Promise<CommandResult>;

export const HANDLERS: Readonly<Record<CommandName, CommandHandler>> = {
  status: statusCommand,
  discover: discoverCommand,
  prepare: prepareCommand,
  commit: commitCommand,
  restore: restoreCommand,
  resume: resumeCommand,
  retire: retireCommand,
  forget: forgetCommand,
  renew: renewCommand,
  checkpoint: checkpointCommand,
  serve: serveCommand,
  up: upCommand,
  down: downCommand,
  crash: crashCommand,
  run: runCommand,
  'checkpoint-now': checkpointNowCommand,
  demo: demoCommand,
};
