/**
 * Real gym servers in-process (core's createGymApp + a MemoryParticipant each) on port 0, and a
 * stack file naming them, for running the CLI against.
 */
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';

import {
  createGymApp,
  listen,
  type ListeningServer,
  type Logger,
  type ParticipantKind,
  type ServerKind,
} from '@ckpt-gym/core/server';

import { MemoryParticipant } from './memory-participant.js';

export const TOKEN = 'test-token';
/** The stack file reads the token from this variable, as a deployment would. */
export const TOKEN_ENV = 'TEST_CKPT_TOKEN';

const silent: Logger = {
  error: () => undefined,
  warn: () => undefined,
  info: () => undefined,
  debug: () => undefined,
  child: () => silent,
};

export interface MemberSpec {
  name: string;
  kind: ServerKind;
  /** False: a server without checkpoint routes (status 404). */
  participates?: boolean;
}

export interface TestStack {
  readonly file: string;
  readonly participants: Map<string, MemoryParticipant>;
  participant(name: string): MemoryParticipant;
  close(): Promise<void>;
}

export const DEFAULT_MEMBERS: MemberSpec[] = [
  { name: 'env', kind: 'environment' },
  { name: 'policy', kind: 'model' },
  { name: 'tools', kind: 'resources' },
];

export async function startStack(
  dir: string,
  members: MemberSpec[] = DEFAULT_MEMBERS,
  options: { file?: string; extraServers?: string[]; signingKey?: string } = {},
): Promise<TestStack> {
  const participants = new Map<string, MemoryParticipant>();
  const servers: ListeningServer[] = [];
  const planes: { dispose(): void }[] = [];
  const lines: string[] = [];
  for (const member of members) {
    const participates = member.participates ?? true;
    const participant = participates
      ? new MemoryParticipant(member.kind as ParticipantKind, member.name)
      : undefined;
    const gym = createGymApp({
      name: member.name,
      kind: member.kind,
      checkpoint: participates
        ? {
            enabled: true,
            controlAuthToken: TOKEN,
            leaseGraceSeconds: 600,
            ...(options.signingKey ? { signingKey: Buffer.from(options.signingKey) } : {}),
          }
        : undefined,
      participant,
      logger: silent,
    });
    if (gym.plane) planes.push(gym.plane);
    const server = await listen(gym.finish(), 0);
    servers.push(server);
    if (participant) participants.set(member.name, participant);
    lines.push(`  ${member.name}: { kind: ${member.kind}, app: test, port: ${server.port} }`);
  }
  const file = join(dir, options.file ?? 'stack.yaml');
  writeFileSync(
    file,
    [
      'checkpoint:',
      '  enabled: true',
      `  control_auth_token: \${${TOKEN_ENV}}`,
      ...(options.signingKey ? [`  signing_key: ${JSON.stringify(options.signingKey)}`] : []),
      'servers:',
      ...lines,
      ...(options.extraServers ?? []),
      '',
    ].join('\n'),
  );
  return {
    file,
    participants,
    participant(name) {
      const found = participants.get(name);
      if (!found) throw new Error(`no participant ${name}`);
      return found;
    },
    async close() {
      for (const plane of planes) plane.dispose();
      await Promise.all(servers.map((server) => server.close()));
    },
  };
}

/** Captured output of one in-process CLI run. */
export interface CliRun {
  code: number;
  stdout: string;
  stderr: string;
}
