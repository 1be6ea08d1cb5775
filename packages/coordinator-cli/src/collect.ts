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

import {
  type EpisodeId,
  captureKey,
  type HttpClients,
  isErrorCode,
  retryRule,
} from '@ckpt-gym/core';

import { describe } from './context.js';

export const ADMISSION_RETRY_MS = 200;

export interface TaskSpec {
  readonly task_id: { readonly taskset: string; readonly task_id: string };
  readonly task_input: Readonly<Record<string, unknown>>;
}

/** One line of the input: a task, and the rollout that runs it. */
export interface InputTask {
  readonly rolloutId: string;
  readonly task: TaskSpec;
}

export interface Dispatch {
  readonly episode: EpisodeId;
  readonly task: TaskSpec;
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
      const reply = await this.opts.client.post(`${this.opts.envUrl}/run`, {
        json: { episode_id: dispatch.episode, task: dispatch.task },
        retry: { limit: 0 },
        throwHttpErrors: false,
        signal,
      });
      const body = parseBody(reply.body);
      const status = reply.statusCode;
      if (status === 200) {
        const reply200 = body as { result?: unknown; failure?: unknown };
        return {
          rollout_id: dispatch.episode.rollout_id,
          attempt: dispatch.episode.attempt,
          task_id: dispatch.task.task_id,
          result: (reply200.result ?? null) as Record<string, unknown> | null,
          failure: (reply200.failure ?? null) as Record<string, unknown> | null,
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

function parseBody(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return null;
  }
}

/** Parses the input: one task a line (blank lines skipped); the rollout id defaults to `r<line>`. */
export function parseTasks(text: string): InputTask[] {
  const tasks: InputTask[] = [];
  const seen = new Set<string>();
  text.split('\n').forEach((line, index) => {
    if (line.trim() === '') return;
    const where = `line ${index + 1}`;
    let row: Record<string, unknown>;
    try {
      row = JSON.parse(line) as Record<string, unknown>;
    } catch (err) {
      throw new Error(`${where}: not JSON: ${(err as Error).message}`);
    }
    const taskId = row.task_id as { taskset?: unknown; task_id?: unknown } | undefined;
    if (typeof taskId?.taskset !== 'string' || typeof taskId.task_id !== 'string') {
      throw new Error(`${where}: task_id must be {taskset, task_id} (strings)`);
    }
    if (typeof row.task_input !== 'object' || row.task_input === null) {
      throw new Error(`${where}: task_input must be an object`);
    }
    const rolloutId = typeof row.rollout_id === 'string' ? row.rollout_id : `r${index + 1}`;
    if (seen.has(rolloutId)) throw new Error(`${where}: rollout id ${rolloutId} appears twice`);
    seen.add(rolloutId);
    tasks.push({
      rolloutId,
      task: {
        task_id: { taskset: taskId.taskset, task_id: taskId.task_id },
        task_input: row.task_input as Record<string, unknown>,
      },
    });
  });
  return tasks;
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
