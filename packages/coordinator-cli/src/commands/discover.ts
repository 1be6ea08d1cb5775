/** `discover`: the participants and their kinds, in prepare order. */
import type { CommandContext } from '../context.js';
import { ExitCode } from '../exit-codes.js';
import { type CommandResult, table } from '../output.js';

export async function discoverCommand(ctx: CommandContext): Promise<CommandResult> {
  const participants = await ctx.participants();
  const members = participants.members.map(({ server, kind, url }) => ({ server, kind, url }));
  return {
    exitCode: ExitCode.OK,
    data: { config: ctx.configPath, participants: members },
    text: [
      table(
        ['SERVER', 'KIND', 'URL'],
        members.map((member) => [member.server, member.kind, member.url]),
      ),
      '',
      `${members.length} participant(s) found in ${ctx.configPath}`,
    ].join('\n'),
  };
}
