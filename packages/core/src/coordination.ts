/**
 * The controller side of the checkpoint protocol. Gym owns the participant order, so a training
 * controller calls these functions instead of sequencing servers itself. They keep no state
 * between calls: each is safe to retry with the same checkpoint id.
 *
 * Order: prepare environment → model → agent → resources (stop at the first stage not prepared);
 * commit, restore and renew fan out to all at once; resume runs the prepare order in reverse and
 * collects failures; retire and forget run callers first (environment, agent, model + resources).
 */
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';

import { withinDeadline } from './control/deadline.js';
import { CheckpointStateError, ConfigError } from './errors.js';
import { ControlHttpError, getControl, postControl, type HttpClients } from './http-client.js';
import {
  captureKey,
  episodeIdToJson,
  nextAttempt,
  parseCaptureKey,
  type EpisodeId,
} from './identity.js';
import { createLogger, type Logger } from './logging.js';
import {
  isParticipantKind,
  PREPARE_ORDER,
  RETIRE_ORDER,
  type ParticipantKind,
} from './participant.js';
import { serverUrl, type StackSettings } from './settings.js';
import { MANIFEST_FILE, participantDir, readParticipantState } from './store.js';
import { ATTR_PREPARED, inCoordinateSpan, inStageSpan } from './telemetry/checkpoint-spans.js';

export const CHECKPOINT_ROUTE_PREFIX = '/ng-control/v1/checkpoint';
/** Added to a call's remaining deadline: the participant bounds its work, this covers the reply. */
export const REPLY_SLACK_SECONDS = 5;
/** A failed restore's cleanup gets at least this long, even when the restore's deadline passed. */
export const RESTORE_CLEANUP_SECONDS = 30;
export const DISCOVER_TRIES = 3;
export const DISCOVER_TIMEOUT_SECONDS = 60;
const DISCOVER_RETRY_SLEEP_MS = 500;

/** Transport errors worth another try: the server was not (yet) there, or dropped the connection. */
const CONNECTION_ERROR_CODES = new Set([
  'ECONNREFUSED',
  'ECONNRESET',
  'EPIPE',
  'EHOSTUNREACH',
  'ENETUNREACH',
  'ENOTFOUND',
  'EAI_AGAIN',
]);

export interface ParticipantMember {
  /** The server's name in the stack file (the key replies and failures are reported under). */
  readonly server: string;
  readonly kind: ParticipantKind;
  /** Base URL, e.g. `http://127.0.0.1:8101`. */
  readonly url: string;
  /** The instance its status names (its directory in a checkpoint); default: `server`. */
  readonly instance?: string;
}

/** Where swallowed cleanup errors are reported; any `Logger` will do. */
export type CoordinationLogger = Pick<Logger, 'warn'>;

export interface Participants {
  /** Sorted by prepare order, then server name. */
  readonly members: readonly ParticipantMember[];
  readonly token: string;
  readonly clients: Pick<HttpClients, 'control'>;
  /** Where swallowed cleanup errors go (default: a JSON logger on stdout). */
  readonly logger?: CoordinationLogger;
}

export type ControlReply = Record<string, unknown>;
/** Replies by server name. */
export type Replies = Record<string, ControlReply>;

/** One or more participants failed a coordination step; `failures` names every one of them. */
export class CoordinationError extends Error {
  constructor(
    readonly operation: string,
    readonly failures: Readonly<Record<string, string>>,
  ) {
    const servers = Object.keys(failures).sort();
    const listed = servers.map((server) => `${server}: ${failures[server]}`).join('; ');
    super(`checkpoint ${operation} failed on ${servers.length} participant(s): ${listed}`);
    this.name = 'CoordinationError';
  }
}

function memberOrder(a: ParticipantMember, b: ParticipantMember): number {
  const byKind = PREPARE_ORDER.indexOf(a.kind) - PREPARE_ORDER.indexOf(b.kind);
  if (byKind !== 0) return byKind;
  return a.server < b.server ? -1 : a.server > b.server ? 1 : 0;
}

/** Participants from known members (discover builds them from status replies). */
export function createParticipants(
  members: Iterable<ParticipantMember>,
  options: { token: string; clients: Pick<HttpClients, 'control'>; logger?: CoordinationLogger },
): Participants {
  const sorted = [...members].sort(memberOrder);
  const names = new Set<string>();
  for (const member of sorted) {
    if (names.has(member.server)) {
      throw new ConfigError(`participant ${member.server} is listed twice`);
    }
    names.add(member.server);
  }
  return {
    members: sorted,
    token: options.token,
    clients: options.clients,
    logger: options.logger,
  };
}

// ---------------------------------------------------------------------------------------------
// Transport.

function nowSeconds(): number {
  return Date.now() / 1000;
}

/** How long to wait for a reply: what is left of the deadline, plus the reply slack. */
export function replyTimeoutMs(deadlineTs: number, now = nowSeconds()): number {
  return (Math.max(deadlineTs - now, 0) + REPLY_SLACK_SECONDS) * 1000;
}

function routeUrl(baseUrl: string, route: string): string {
  return `${baseUrl.replace(/\/+$/, '')}${CHECKPOINT_ROUTE_PREFIX}/${route}`;
}

function describeError(err: unknown): string {
  if (err instanceof Error) return err.message || err.name;
  return String(err);
}

/** Encoded once per fan-out: every participant gets the same bytes. */
function encodeBody(body: Record<string, unknown>): Buffer {
  return Buffer.from(JSON.stringify(body), 'utf8');
}

/**
 * POSTs `body` to `route` on every member at once. Any failure fails the whole stage: its
 * successful replies are discarded and every failing server is named.
 */
async function fanOut(
  participants: Participants,
  members: readonly ParticipantMember[],
  route: string,
  body: Buffer,
  deadlineTs: number,
): Promise<Replies> {
  const timeoutMs = replyTimeoutMs(deadlineTs);
  const settled = await Promise.allSettled(
    members.map((member) =>
      postControl(participants.clients.control, routeUrl(member.url, route), body, {
        token: participants.token,
        timeoutMs,
      }),
    ),
  );
  const replies: Replies = {};
  const failures: Record<string, string> = {};
  settled.forEach((outcome, index) => {
    const server = (members[index] as ParticipantMember).server;
    if (outcome.status === 'fulfilled') replies[server] = outcome.value;
    else failures[server] = describeError(outcome.reason);
  });
  if (Object.keys(failures).length > 0) throw new CoordinationError(route, failures);
  return replies;
}

function membersOfKinds(
  participants: Participants,
  kinds: readonly ParticipantKind[],
): ParticipantMember[] {
  return participants.members.filter((member) => kinds.includes(member.kind));
}

/** Runs `route` stage by stage; the first failing stage throws and later stages are not called. */
async function inStages(
  participants: Participants,
  stages: readonly (readonly ParticipantKind[])[],
  route: string,
  body: Buffer,
  deadlineTs: number,
): Promise<Replies> {
  const replies: Replies = {};
  for (const kinds of stages) {
    const members = membersOfKinds(participants, kinds);
    if (members.length === 0) continue;
    const stage = () => fanOut(participants, members, route, body, deadlineTs);
    Object.assign(replies, await inStageSpan(route, kinds, members.length, stage));
  }
  return replies;
}

// ---------------------------------------------------------------------------------------------
// Discover.

export interface DiscoverTarget {
  readonly name: string;
  readonly url: string;
}

export interface DiscoverOptions {
  token: string;
  clients: Pick<HttpClients, 'control'>;
  /** Connection attempts per server (connection errors only). */
  tries?: number;
  /** Bounds each server's whole probe, retries included. */
  probeTimeoutSeconds?: number;
  logger?: CoordinationLogger;
}

function stackTargets(stack: StackSettings): DiscoverTarget[] {
  return [...stack.servers.values()]
    .filter((server) => server.kind !== 'inference')
    .map((server) => ({ name: server.name, url: serverUrl(stack, server.name) }));
}

function isConnectionError(err: unknown): boolean {
  const code = (err as { code?: unknown } | null)?.code;
  return typeof code === 'string' && CONNECTION_ERROR_CODES.has(code);
}

/** One server's status: its member entry, or undefined when it does not take part (404). */
async function probe(
  target: DiscoverTarget,
  options: DiscoverOptions,
): Promise<ParticipantMember | undefined> {
  const tries = options.tries ?? DISCOVER_TRIES;
  const timeoutSeconds = options.probeTimeoutSeconds ?? DISCOVER_TIMEOUT_SECONDS;
  const signal = AbortSignal.timeout(timeoutSeconds * 1000);
  const url = routeUrl(target.url, 'status');
  let lastError: unknown;
  try {
    for (let attempt = 1; ; attempt += 1) {
      try {
        const status = await getControl(options.clients.control, url, {
          token: options.token,
          signal,
        });
        if (!isParticipantKind(status.kind)) {
          throw new Error(`unknown participant kind ${JSON.stringify(status.kind)}`);
        }
        const instance = typeof status.instance === 'string' ? status.instance : target.name;
        return { server: target.name, kind: status.kind, url: target.url, instance };
      } catch (err) {
        if (err instanceof ControlHttpError && err.status === 404) return undefined;
        if (signal.aborted || !isConnectionError(err) || attempt >= tries) throw err;
        lastError = err;
      }
      await sleep(DISCOVER_RETRY_SLEEP_MS, undefined, { signal });
    }
  } catch (err) {
    if (!signal.aborted) throw err;
    const last = lastError === undefined ? '' : ` (last error: ${describeError(lastError)})`;
    throw new Error(`no status reply within ${timeoutSeconds} seconds${last}`);
  }
}

/**
 * Finds the participants: probes `GET status` on every gym server of the stack (or on each
 * target) concurrently. A server answering 404 does not take part. A server that is down, never
 * replies, fails, or reports an unknown kind is a failure; so is a deployment without a model.
 */
export async function discover(
  stack: StackSettings | readonly DiscoverTarget[],
  options: DiscoverOptions,
): Promise<Participants> {
  const targets = Array.isArray(stack)
    ? (stack as readonly DiscoverTarget[])
    : stackTargets(stack as StackSettings);
  const settled = await Promise.allSettled(targets.map((target) => probe(target, options)));
  const members: ParticipantMember[] = [];
  const failures: Record<string, string> = {};
  settled.forEach((outcome, index) => {
    const target = targets[index] as DiscoverTarget;
    if (outcome.status === 'rejected') failures[target.name] = describeError(outcome.reason);
    else if (outcome.value) members.push(outcome.value);
  });
  if (Object.keys(failures).length > 0) throw new CoordinationError('discover', failures);
  if (!members.some((member) => member.kind === 'model')) {
    throw new CoordinationError('discover', {
      deployment: 'no policy model takes part in checkpoints',
    });
  }
  return createParticipants(members, options);
}

// ---------------------------------------------------------------------------------------------
// Prepare.

/** String entries of `reply.report[field]`; a missing report or field is empty. */
function reportKeys(reply: ControlReply, field: 'blockers' | 'restarts'): string[] {
  const report = reply.report as Record<string, unknown> | undefined;
  const keys = report?.[field];
  return Array.isArray(keys) ? keys.filter((key): key is string => typeof key === 'string') : [];
}

export class PrepareResult {
  constructor(
    /** True when every participant replied `prepared`. */
    readonly prepared: boolean,
    /** Replies of every stage contacted. */
    readonly replies: Readonly<Replies>,
  ) {}

  /** Capture keys still blocking, by server, for each reply not `prepared`. */
  blockers(): Record<string, string[]> {
    const out: Record<string, string[]> = {};
    for (const [server, reply] of Object.entries(this.replies)) {
      if (reply.phase !== 'prepared') out[server] = reportKeys(reply, 'blockers');
    }
    return out;
  }

  /** Episodes some participant cannot capture (a rollout restarts if any part of it does); sorted by key. */
  restarts(): EpisodeId[] {
    const keys = new Set(
      Object.values(this.replies).flatMap((reply) => reportKeys(reply, 'restarts')),
    );
    return [...keys].sort().map(parseCaptureKey);
  }

  /** The commit scope: `episodeIds` in their order, minus the restarts. */
  continued(episodeIds: readonly EpisodeId[]): EpisodeId[] {
    const restarting = new Set(this.restarts().map(captureKey));
    return episodeIds.filter((episode) => !restarting.has(captureKey(episode)));
  }
}

/**
 * Prepares stage by stage in prepare order, stopping at the first stage with a reply that is not
 * `prepared` (later stages are never contacted). Each later stage is sent, as `restarts`, the
 * restarts earlier stages reported, so it neither waits for nor exports them.
 */
export function prepare(
  participants: Participants,
  checkpointId: string,
  deadlineTs: number,
): Promise<PrepareResult> {
  const count = participants.members.length;
  return inCoordinateSpan('prepare', checkpointId, count, async (span) => {
    const result = await prepareInOrder(participants, checkpointId, deadlineTs);
    span?.setAttribute(ATTR_PREPARED, result.prepared);
    return result;
  });
}

async function prepareInOrder(
  participants: Participants,
  checkpointId: string,
  deadlineTs: number,
): Promise<PrepareResult> {
  const replies: Replies = {};
  const carried = new Set<string>();
  for (const kind of PREPARE_ORDER) {
    const members = membersOfKinds(participants, [kind]);
    if (members.length === 0) continue;
    const body = encodeBody({
      checkpoint_id: checkpointId,
      deadline_ts: deadlineTs,
      ...(carried.size > 0 ? { restarts: [...carried].sort() } : {}),
    });
    const stage = await inStageSpan('prepare', [kind], members.length, async (span) => {
      const stageReplies = await fanOut(participants, members, 'prepare', body, deadlineTs);
      const prepared = Object.values(stageReplies).every((reply) => reply.phase === 'prepared');
      span?.setAttribute(ATTR_PREPARED, prepared);
      return stageReplies;
    });
    Object.assign(replies, stage);
    if (Object.values(stage).some((reply) => reply.phase !== 'prepared')) {
      return new PrepareResult(false, replies);
    }
    for (const reply of Object.values(stage))
      for (const key of reportKeys(reply, 'restarts')) carried.add(key);
  }
  return new PrepareResult(true, replies);
}

// ---------------------------------------------------------------------------------------------
// Commit, restore, resume, renew, retire, forget.

/**
 * Commits on every participant at once. `episodeIds` names every continued episode: each one in
 * flight (use `PrepareResult.continued`) and each unclaimed restored one, by its replacement attempt.
 * Publishing the checkpoint is the controller's, after every commit succeeded; then resume.
 */
export function commit(
  participants: Participants,
  checkpointId: string,
  checkpointDir: string,
  episodeIds: readonly EpisodeId[],
  deadlineTs: number,
  options: { stop?: boolean } = {},
): Promise<Replies> {
  const body = encodeBody({
    checkpoint_id: checkpointId,
    deadline_ts: deadlineTs,
    checkpoint_dir: checkpointDir,
    episode_ids: episodeIds.map(episodeIdToJson),
    ...(options.stop ? { stop: true } : {}),
  });
  return inCoordinateSpan('commit', checkpointId, participants.members.length, () =>
    fanOut(participants, participants.members, 'commit', body, deadlineTs),
  );
}

// ---------------------------------------------------------------------------------------------
// The restore's cross-participant checks: run by the controller, which can read the checkpoint
// directory, before any participant is sent anything (the restore body names no expected id).

/** What the controller's own record of the checkpoint says; every manifest must agree with it. */
export interface ExpectedCheckpoint {
  /** The record's path, named in every refusal it causes (e.g. `<dir>/controller.json`). */
  readonly source: string;
  readonly checkpointId: string;
  /** Records per participant (server name), as committed. */
  readonly recordCounts?: Readonly<Record<string, number>>;
  /** Capture keys each participant (server name) committed a record of: it must still hold them. */
  readonly heldBy?: Readonly<Record<string, readonly string[]>>;
}

export interface RestoreCheckOptions {
  readonly expected?: ExpectedCheckpoint;
  /**
   * Leave out, as restarts, the scope episodes a participant that must hold them does not,
   * instead of refusing the restore. Only when the controller asks for it explicitly.
   */
  readonly allowRestart?: boolean;
}

/** One participant's side of the checkpoint, as read (and fully verified) from its directory. */
export interface ParticipantSource {
  readonly member: ParticipantMember;
  readonly manifestPath: string;
  readonly checkpointId: string;
  readonly recordCount: number;
  /** Capture keys of every record the participant holds. */
  readonly held: ReadonlySet<string>;
}

export interface CheckedRestore {
  /** The scope to restore: every episode of the request, minus `restarts`. */
  readonly scope: EpisodeId[];
  /** Episodes not held where they must be, left out to start over (`allowRestart` only). */
  readonly restarts: EpisodeId[];
}

/** Reads one participant's manifest and the keys of its records through the store's own checks. */
async function readSource(member: ParticipantMember, checkpointDir: string) {
  const held = new Set<string>();
  const { manifest } = await readParticipantState<never>({
    checkpointDir,
    kind: member.kind,
    instance: member.instance ?? member.server,
    select: (key) => {
      held.add(key);
      return false;
    },
    validate: () => {
      throw new Error('no record is selected');
    },
  });
  const dir = participantDir(checkpointDir, member.kind, member.instance ?? member.server);
  const manifestPath = join(dir, MANIFEST_FILE);
  return {
    member,
    manifestPath,
    checkpointId: manifest.checkpoint_id,
    recordCount: manifest.record_count,
    held,
  } satisfies ParticipantSource;
}

/** Every manifest names one checkpoint id, the one the controller's record names. */
export function sameCheckpointRefusal(
  sources: readonly ParticipantSource[],
  expected?: ExpectedCheckpoint,
): string | undefined {
  const first = sources[0];
  const [reference, wanted] = expected
    ? [expected.source, expected.checkpointId]
    : [first?.manifestPath, first?.checkpointId];
  const other = sources.find((source) => source.checkpointId !== wanted);
  if (other === undefined) return undefined;
  return (
    `${other.manifestPath} names checkpoint ${JSON.stringify(other.checkpointId)}, but ` +
    `${reference} names ${JSON.stringify(wanted)}: every participant must restore the same checkpoint`
  );
}

/** Every participant holds as many records as the controller's record says it committed. */
export function recordCountRefusal(
  sources: readonly ParticipantSource[],
  expected?: ExpectedCheckpoint,
): string | undefined {
  const counts = expected?.recordCounts;
  if (counts === undefined) return undefined;
  for (const source of sources) {
    const count = counts[source.member.server];
    if (count === source.recordCount) continue;
    return (
      `${source.manifestPath} holds ${source.recordCount} record(s), but ${expected?.source} ` +
      `names ${count === undefined ? 'no record count' : `${count} record(s)`} for ` +
      `${source.member.server}: the checkpoint must hold what was committed`
    );
  }
  return undefined;
}

/**
 * Scope episodes a participant that must hold them does not, each with the manifests of the
 * participants missing it: some participant must hold every one, and each participant every one
 * `heldBy` (the controller's record) says it committed. Not "an environment must": an episode run
 * through an agent's legacy `/run` is held by the agent alone.
 */
export function unheldEpisodes(
  sources: readonly ParticipantSource[],
  scope: readonly EpisodeId[],
  heldBy: Readonly<Record<string, readonly string[]>> = {},
): Map<string, string[]> {
  const owners = sources.filter((source) => source.member.kind === 'environment');
  const committed = new Map(sources.map((s) => [s, new Set(heldBy[s.member.server] ?? [])]));
  const unheld = new Map<string, string[]>();
  for (const key of scope.map(captureKey)) {
    const missing = sources
      .filter((source) => committed.get(source)?.has(key) && !source.held.has(key))
      .map((source) => source.manifestPath);
    if (!sources.some((source) => source.held.has(key))) {
      // Held by no one: name the environments, which own episodes, or else every participant.
      const expected = owners.length > 0 ? owners : sources;
      missing.push(
        ...expected.filter((o) => !missing.includes(o.manifestPath)).map((o) => o.manifestPath),
      );
    }
    if (missing.length > 0) unheld.set(key, missing);
  }
  return unheld;
}

function unheldRefusal(unheld: ReadonlyMap<string, string[]>): string {
  const listed = [...unheld]
    .slice(0, 10)
    .map(([key, files]) => `${key} (not in ${files.join(', ')})`)
    .join(', ');
  return (
    `${unheld.size} episode(s) in the restore scope are not held by a participant that must ` +
    `hold them: ${listed}${unheld.size > 10 ? ', …' : ''}; an episode must not silently start ` +
    'over (restart it explicitly)'
  );
}

/**
 * The restore's cross-participant checks, before anything is installed: every participant's
 * directory passes the store's checks, every manifest names the same checkpoint (and the one
 * `expected` names), record counts match `expected`, and every scope episode is held by some
 * environment participant and by each participant `expected` says committed it. A failure is `invalid_checkpoint_state` naming the file and the rule.
 */
export async function checkRestore(
  participants: Participants,
  checkpointDir: string,
  episodeIds: readonly EpisodeId[],
  options: RestoreCheckOptions = {},
): Promise<CheckedRestore> {
  const sources = await Promise.all(
    participants.members.map((member) => readSource(member, checkpointDir)),
  );
  const refusal =
    sameCheckpointRefusal(sources, options.expected) ??
    recordCountRefusal(sources, options.expected);
  if (refusal !== undefined) throw new CheckpointStateError(refusal);
  const unheld = unheldEpisodes(sources, episodeIds, options.expected?.heldBy);
  if (unheld.size > 0 && !options.allowRestart) {
    throw new CheckpointStateError(unheldRefusal(unheld));
  }
  return {
    scope: episodeIds.filter((episode) => !unheld.has(captureKey(episode))),
    restarts: episodeIds.filter((episode) => unheld.has(captureKey(episode))),
  };
}

/**
 * Restores on every participant, all or nothing. First the cross-participant checks
 * (`checkRestore`, strict: an unheld episode is refused): a refusal sends nothing. When a
 * participant still fails, it retires the replacement attempts on the participants that accepted
 * (one that refused installed nothing and raised no marks) and always resumes everyone (both
 * logged, never raised), then raises the restore's own error.
 */
export function restore(
  participants: Participants,
  checkpointId: string,
  checkpointDir: string,
  episodeIds: readonly EpisodeId[],
  deadlineTs: number,
  options: { expected?: ExpectedCheckpoint } = {},
): Promise<Replies> {
  return inCoordinateSpan('restore', checkpointId, participants.members.length, () =>
    restoreAll(participants, checkpointId, checkpointDir, episodeIds, deadlineTs, options),
  );
}

async function restoreAll(
  participants: Participants,
  checkpointId: string,
  checkpointDir: string,
  episodeIds: readonly EpisodeId[],
  deadlineTs: number,
  options: { expected?: ExpectedCheckpoint },
): Promise<Replies> {
  // Bounded like the restore itself: a stalled read of the directory (a hung mount) gives up.
  await withinDeadline(checkRestore(participants, checkpointDir, episodeIds, options), deadlineTs);
  const body = encodeBody({
    checkpoint_id: checkpointId,
    deadline_ts: deadlineTs,
    checkpoint_dir: checkpointDir,
    episode_ids: episodeIds.map(episodeIdToJson),
  });
  try {
    return await fanOut(participants, participants.members, 'restore', body, deadlineTs);
  } catch (restoreError) {
    const refused = restoreError instanceof CoordinationError ? restoreError.failures : {};
    const accepted = participants.members.filter((member) => !(member.server in refused));
    await cleanUpFailedRestore(
      { ...participants, members: accepted },
      participants,
      checkpointId,
      episodeIds,
      deadlineTs,
    );
    throw restoreError;
  }
}

/** Retires the replacement attempts where a restore was accepted, then resumes everyone. */
async function cleanUpFailedRestore(
  accepted: Participants,
  everyone: Participants,
  checkpointId: string,
  episodeIds: readonly EpisodeId[],
  deadlineTs: number,
): Promise<void> {
  const logger = everyone.logger ?? createLogger({ server: 'coordinator' });
  const cleanupDeadline = Math.max(deadlineTs, nowSeconds() + RESTORE_CLEANUP_SECONDS);
  try {
    await retire(accepted, checkpointId, episodeIds.map(nextAttempt), cleanupDeadline);
  } catch (err) {
    logger.warn('failed restore: retiring the replacement attempts failed', {
      checkpoint_id: checkpointId,
      error: describeError(err),
    });
  }
  try {
    await resume(everyone, checkpointId, cleanupDeadline);
  } catch (err) {
    logger.warn('failed restore: resume failed', {
      checkpoint_id: checkpointId,
      error: describeError(err),
    });
  }
}

/**
 * Resumes in reverse prepare order. A failing stage does not stop later ones; every failure is
 * raised together at the end (an unreachable participant resumes itself when its lease expires).
 */
export function resume(
  participants: Participants,
  checkpointId: string,
  deadlineTs: number,
): Promise<Replies> {
  return inCoordinateSpan('resume', checkpointId, participants.members.length, () =>
    resumeInReverse(participants, checkpointId, deadlineTs),
  );
}

async function resumeInReverse(
  participants: Participants,
  checkpointId: string,
  deadlineTs: number,
): Promise<Replies> {
  const body = encodeBody({ checkpoint_id: checkpointId, deadline_ts: deadlineTs });
  const replies: Replies = {};
  const failures: Record<string, string> = {};
  for (const kind of [...PREPARE_ORDER].reverse()) {
    const members = membersOfKinds(participants, [kind]);
    if (members.length === 0) continue;
    const stage = () => fanOut(participants, members, 'resume', body, deadlineTs);
    try {
      Object.assign(replies, await inStageSpan('resume', [kind], members.length, stage));
    } catch (err) {
      if (!(err instanceof CoordinationError)) throw err;
      Object.assign(failures, err.failures);
    }
  }
  if (Object.keys(failures).length > 0) throw new CoordinationError('resume', failures);
  return replies;
}

/** Extends every participant's lease, e.g. when publishing outlasts the last one. */
export function renew(
  participants: Participants,
  checkpointId: string,
  deadlineTs: number,
): Promise<Replies> {
  const body = encodeBody({ checkpoint_id: checkpointId, deadline_ts: deadlineTs });
  return inCoordinateSpan('renew', checkpointId, participants.members.length, () =>
    fanOut(participants, participants.members, 'renew', body, deadlineTs),
  );
}

/**
 * Retires attempts everywhere, callers before the servers they call; the first failing stage
 * raises. Nothing is sent when `episodeIds` is empty. Refused while a checkpoint is open.
 */
export async function retire(
  participants: Participants,
  checkpointId: string,
  episodeIds: readonly EpisodeId[],
  deadlineTs: number,
): Promise<Replies> {
  if (episodeIds.length === 0) return {};
  const body = encodeBody({
    checkpoint_id: checkpointId,
    deadline_ts: deadlineTs,
    episode_ids: episodeIds.map(episodeIdToJson),
  });
  return inCoordinateSpan('retire', checkpointId, participants.members.length, () =>
    inStages(participants, RETIRE_ORDER, 'retire', body, deadlineTs),
  );
}

/**
 * Ends the retired marks of rollouts done for good, in retire order. Sends each id once, sorted;
 * nothing is sent when `rolloutIds` is empty.
 */
export async function forget(
  participants: Participants,
  checkpointId: string,
  rolloutIds: Iterable<string>,
  deadlineTs: number,
): Promise<Replies> {
  const unique = [...new Set(rolloutIds)].sort();
  if (unique.length === 0) return {};
  const body = encodeBody({
    checkpoint_id: checkpointId,
    deadline_ts: deadlineTs,
    rollout_ids: unique,
  });
  return inCoordinateSpan('forget', checkpointId, participants.members.length, () =>
    inStages(participants, RETIRE_ORDER, 'forget', body, deadlineTs),
  );
}
