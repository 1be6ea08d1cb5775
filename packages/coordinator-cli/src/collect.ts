/**
 * Collecting rollouts: episodes sent to an environment server's `POST /run`, a bounded number at
 * once, each reply handed on once. `run` and the demo are built on it.
 *
 * A request the server refuses with a code whose catalogue retry rule is `after_resume` (409
 * `admission_closed`: a checkpoint is open) owns nothing, so it is sent again, same attempt, once
 * admission may have reopened. Any other failure to get a reply (the stack crashed, the attempt
 * was retired) leaves the episode *lost*: it has no result, and whoever drives the collection
 * decides what comes next (continue it after a restore, or retire it and start it over).
 */
import { setMaxListeners } from 'node:events';

import { type HttpClients } from '@ckpt-gym/core/client';
import { type EpisodeId, captureKey, isErrorCode, retryRule } from '@ckpt-gym/core/protocol';

import {
  flatRowFromTask,
  flatRunBody,
  isNemoRow,
  type JsonRow,
  nemoNativeTask,
  nemoTasks,
} from './collection/nemo.js';
import { describe } from './context.js';

export const ADMISSION_RETRY_MS = 200;

export interface TaskSpec {
  readonly task_id: { readonly taskset: string; readonly task_id: string };
  readonly task_input: Readonly<Record<string, unknown>>;
}

/** One task of the input: its key within the run, the task, and the NeMo Gym row it came from. */
export interface InputTask {
  /** The task's own identity; its rollout id is derived from the run id and this. */
  readonly key: string;
  readonly task: TaskSpec;
  readonly row?: JsonRow;
}

export interface Dispatch {
  readonly episode: EpisodeId;
  readonly task: TaskSpec;
  /** The flat row a `single_agent_turn_legacy` environment gets (default: the task as one). */
  readonly row?: JsonRow;
}

/** One line of the output: the environment server's reply, with the episode that produced it. */
export interface ResultRow {
  readonly rollout_id: string;
  readonly attempt: number;
  readonly task_id: TaskSpec['task_id'];
  readonly result: Record<string, unknown> | null;
  readonly failure: Record<string, unknown> | null;
}

export interface CollectorOptions {
  readonly envUrl: string;
  readonly concurrency: number;
  /** `/run` goes over this data client (no retries: a resent attempt is the caller's choice). */
  readonly client: HttpClients['data'];
  /** Called once per reply, in completion order; the collector waits for it. */
  readonly onResult: (row: ResultRow) => Promise<void> | void;
  /** Called once per episode that ended without a reply. */
  readonly onLost?: (dispatch: Dispatch, reason: string) => void;
  /** Called before each send (the attempt journal). */
  readonly onSend?: (dispatch: Dispatch) => Promise<void> | void;
  /** The environment takes flat rows (`single_agent_turn_legacy`), not `{episode_id, task}`. */
  readonly flat?: boolean;
}

const sleep = (ms: number) => new Promise((done) => setTimeout(done, ms));

/** Whether a reply body is a refusal to send again after resume (`admission_closed`). */
export function retriesAfterResume(body: unknown): boolean {
  const code = (body as { error?: { code?: unknown } } | null)?.error?.code;
  return isErrorCode(code) && retryRule(code) === 'after_resume';
}

export class Collector {
  readonly #queue: Dispatch[] = [];
  /** By rollout id. */
  readonly inFlight = new Map<string, Dispatch>();
  readonly lost = new Map<string, { dispatch: Dispatch; reason: string }>();
  #paused = false;
  readonly #abort = new AbortController();
  #idle: (() => void)[] = [];

  constructor(private readonly opts: CollectorOptions) {
    // Every request in flight listens on the one signal that aborts them all.
    setMaxListeners(0, this.#abort.signal);
  }

  enqueue(dispatches: Iterable<Dispatch>): void {
    for (const dispatch of dispatches) {
      this.lost.delete(dispatch.episode.rollout_id);
      this.#queue.push(dispatch);
    }
    this.#pump();
  }

  get queued(): number {
    return this.#queue.length;
  }

  /** No new sends until `unpause` (episodes in flight go on). */
  pause(): void {
    this.#paused = true;
  }

  unpause(): void {
    this.#paused = false;
    this.#pump();
  }

  /** Drops every request in flight and everything queued; nothing more is sent. */
  abort(): void {
    this.#queue.length = 0;
    this.#abort.abort();
  }

  /** Resolves once nothing is queued or in flight. */
  settled(): Promise<void> {
    if (this.#isIdle()) return Promise.resolve();
    return new Promise((done) => this.#idle.push(done));
  }

  #isIdle(): boolean {
    return this.inFlight.size === 0 && (this.#queue.length === 0 || this.#abort.signal.aborted);
  }

  #pump(): void {
    while (
      !this.#paused &&
      !this.#abort.signal.aborted &&
      this.inFlight.size < this.opts.concurrency &&
      this.#queue.length > 0
    ) {
      const dispatch = this.#queue.shift()!;
      this.inFlight.set(dispatch.episode.rollout_id, dispatch);
      void this.#run(dispatch).finally(() => {
        this.inFlight.delete(dispatch.episode.rollout_id);
        this.#pump();
        if (this.#isIdle()) for (const done of this.#idle.splice(0)) done();
      });
    }
  }

  async #run(dispatch: Dispatch): Promise<void> {
    try {
      await this.opts.onSend?.(dispatch);
      const row = await this.#send(dispatch);
      await this.opts.onResult(row);
    } catch (err) {
      const reason = describe(err);
      this.lost.set(dispatch.episode.rollout_id, { dispatch, reason });
      this.opts.onLost?.(dispatch, reason);
    }
  }

  async #send(dispatch: Dispatch): Promise<ResultRow> {
    const signal = this.#abort.signal;
    for (;;) {
      const { episode } = dispatch;
      const reply = await this.opts.client.post(`${this.opts.envUrl}/run`, {
        json: this.opts.flat
          ? flatRunBody(
              dispatch.row ?? flatRowFromTask(dispatch.task),
              episode.rollout_id,
              episode.attempt,
            )
          : { episode_id: episode, task: dispatch.task },
        retry: { limit: 0 },
        throwHttpErrors: false,
        signal,
      });
      const body = parseBody(reply.body);
      const status = reply.statusCode;
      if (status === 200) {
        return {
          rollout_id: episode.rollout_id,
          attempt: episode.attempt,
          task_id: dispatch.task.task_id,
          ...(this.opts.flat ? flatReply(body) : nativeReply(body)),
        };
      }
      if (!retriesAfterResume(body)) {
        throw new Error(`${captureKey(dispatch.episode)}: HTTP ${status} ${reply.body}`);
      }
      await sleep(ADMISSION_RETRY_MS);
      if (signal.aborted) throw new Error('aborted');
    }
  }
}

type ReplyParts = Pick<ResultRow, 'result' | 'failure'>;

function nativeReply(body: unknown): ReplyParts {
  const reply = body as { result?: unknown; failure?: unknown } | null;
  return {
    result: (reply?.result ?? null) as JsonRow | null,
    failure: (reply?.failure ?? null) as JsonRow | null,
  };
}

/** A flat reply is the verify result; a failed episode keeps the native reply (`legacyReply`). */
function flatReply(body: unknown): ReplyParts {
  const reply = body as { episode_id?: unknown; failure?: unknown } | null;
  if (
    reply?.episode_id !== undefined &&
    typeof reply.failure === 'object' &&
    reply.failure !== null
  ) {
    return nativeReply(reply);
  }
  return { result: (reply ?? null) as JsonRow | null, failure: null };
}

function parseBody(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return null;
  }
}

/** The input's JSON rows, with their line numbers (blank lines skipped). */
export function parseJsonLines(text: string): { line: number; row: JsonRow }[] {
  const rows: { line: number; row: JsonRow }[] = [];
  text.split('\n').forEach((line, index) => {
    if (line.trim() === '') return;
    let row: unknown;
    try {
      row = JSON.parse(line);
    } catch (err) {
      throw new Error(`line ${index + 1}: not JSON: ${(err as Error).message}`);
    }
    if (typeof row !== 'object' || row === null || Array.isArray(row)) {
      throw new Error(`line ${index + 1}: not a JSON object`);
    }
    rows.push({ line: index + 1, row: row as JsonRow });
  });
  return rows;
}

export type InputFormat = 'ckpt-gym' | 'nemo';

/** The input's format: NeMo Gym rows when its first row is one, else ours. */
export function detectFormat(rows: readonly { row: JsonRow }[]): InputFormat {
  return rows[0] !== undefined && isNemoRow(rows[0].row) ? 'nemo' : 'ckpt-gym';
}

/**
 * Our input: one task a line, `{task_id: {taskset, task_id}, task_input, rollout_id?}`; the key
 * defaults to `r<line>`.
 */
export function parseTasks(text: string): InputTask[] {
  const tasks: InputTask[] = [];
  const seen = new Set<string>();
  for (const { line, row } of parseJsonLines(text)) {
    const where = `line ${line}`;
    const taskId = row.task_id as { taskset?: unknown; task_id?: unknown } | undefined;
    if (typeof taskId?.taskset !== 'string' || typeof taskId.task_id !== 'string') {
      throw new Error(
        `${where}: task_id must be {taskset, task_id} (strings)` +
          (isNemoRow(row) ? '; this is a NeMo Gym row: pass --format nemo' : ''),
      );
    }
    if (typeof row.task_input !== 'object' || row.task_input === null) {
      throw new Error(`${where}: task_input must be an object`);
    }
    const key = typeof row.rollout_id === 'string' ? row.rollout_id : `r${line}`;
    if (seen.has(key)) throw new Error(`${where}: rollout id ${key} appears twice`);
    seen.add(key);
    tasks.push({
      key,
      task: {
        task_id: { taskset: taskId.taskset, task_id: taskId.task_id },
        task_input: row.task_input as Record<string, unknown>,
      },
    });
  }
  return tasks;
}

/**
 * The tasks of an input file: NeMo Gym rows (each stamped with its indices, `--num-repeats`
 * times) or ours; `limit` keeps the first rows.
 */
export function inputTasks(
  text: string,
  options: { format?: InputFormat; limit?: number; numRepeats?: number },
): { format: InputFormat; tasks: InputTask[] } {
  const rows = parseJsonLines(text);
  const format = options.format ?? detectFormat(rows);
  if (format === 'nemo') {
    const tasks = nemoTasks(
      rows.map((r) => r.row),
      options,
    ).map((t) => ({ key: t.key, task: nemoNativeTask(t.row), row: t.row }));
    return { format, tasks };
  }
  if (options.numRepeats !== undefined) {
    throw new Error('--num-repeats takes NeMo Gym rows (--format nemo)');
  }
  return { format, tasks: parseTasks(text).slice(0, options.limit) };
}

/** A counter task: from `initial_count`, the counter script adds 1 then 2. */
export function counterTask(index: number, initialCount = 3): TaskSpec {
  return {
    task_id: { taskset: 'counter', task_id: String(index) },
    task_input: {
      responses_create_params: {
        input: [{ role: 'user', content: 'Add 1 to the counter, then add 2.' }],
      },
      task_data: { initial_count: initialCount, expected_count: initialCount + 3 },
    },
  };
}

/** The weather task the demo sends. */
export function weatherTask(index: number): TaskSpec {
  return {
    task_id: { taskset: 'weather', task_id: String(index) },
    task_input: {
      responses_create_params: { input: 'What is the weather in SF?' },
      task_data: {},
    },
  };
}
