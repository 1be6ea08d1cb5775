/**
 * A worker's link to its coordinator: connects to the coordinator's socket, joins and adopts the
 * state it gets (closing at once when a checkpoint is open), applies close / open / mark / retire
 * / forget to its `WorkerSide`, reports its gate's snapshot whenever it changes while a checkpoint
 * is open, and forwards every control call that lands on this worker (`controlTarget`). A worker
 * that loses its coordinator stops itself: its server is gone and it could never take part again.
 */
import { connect, type Socket } from 'node:net';

import { CoordinatorUnavailableError, isCkptGymError } from '../errors.js';
import { episodeIdFromJson } from '../identity.js';
import type { JsonObject, JsonValue } from '../json.js';
import type { Logger } from '../logging.js';
import { type ControlTarget, EncodedReply } from '../control/routes.js';
import type { MetricsJson } from '../telemetry/metrics.js';
import { Channel } from './channel.js';
import { WithBytes } from './frames.js';
import type { ForwardedControl } from './coordinator-server.js';
import { replyTimeoutMs, reportRetryDelayMs } from './rules.js';
import {
  type JoinState,
  MESSAGE_TIMEOUT_MS,
  type NumberedReport,
  type WorkerAdmissionRequest,
  type WorkerRegistration,
  type WorkerSide,
} from './types.js';

export interface WorkerLinkOptions {
  readonly socketPath: string;
  /** This worker's index among the server's workers (from 1). */
  readonly index: number;
  readonly logger: Logger;
  /** Names the server's workers in errors and logs. */
  readonly label?: string;
  /** What to do once the coordinator is gone (default: exit 1). */
  readonly onCoordinatorLost?: () => void;
  /** How long `connect` keeps trying (default MESSAGE_TIMEOUT_MS). */
  readonly connectTimeoutMs?: number;
}

function connectOnce(path: string): Promise<Socket> {
  return new Promise((resolve, reject) => {
    const socket = connect(path);
    socket.once('connect', () => {
      socket.off('error', reject);
      resolve(socket);
    });
    socket.once('error', reject);
  });
}

/** A control call's time to wait: its own deadline plus a grace, or the message timeout. */
function forwardTimeoutMs(body: unknown): number {
  const deadline = (body as { deadline_ts?: unknown } | null)?.deadline_ts;
  if (typeof deadline !== 'number' || !Number.isFinite(deadline)) return MESSAGE_TIMEOUT_MS;
  return replyTimeoutMs(deadline, Date.now());
}

export class WorkerLink {
  readonly #options: WorkerLinkOptions;
  readonly #label: string;
  #side: WorkerSide | undefined;
  #channel: Channel | undefined;
  #generation = 0;
  #seq = 0;
  #closed = false;
  #stopping = false;
  #reportRunning = false;
  #reportPending = false;
  #unsubscribe: (() => void) | undefined;

  constructor(options: WorkerLinkOptions) {
    this.#options = options;
    this.#label = options.label ?? 'server';
  }

  get index(): number {
    return this.#options.index;
  }

  /** Connects (retrying until the socket accepts), joins with `side`, and adopts the join state. */
  async attach(side: WorkerSide): Promise<void> {
    this.#side = side;
    const channel = new Channel(await this.#connect(), {
      peer: `the ${this.#label} checkpoint coordinator`,
      logger: this.#options.logger,
      handler: (kind, body, bytes) => this.#handle(kind, body, bytes),
    });
    this.#channel = channel;
    channel.onClose(() => this.#lost());
    const registration: WorkerRegistration = {
      index: this.#options.index,
      pid: process.pid,
      extra: side.registration?.() ?? {},
    };
    const state = (await channel.call('join', registration)) as unknown as JoinState;
    side.marks.forget([...side.marks.rollouts()]);
    for (const [rollout, attempt] of Object.entries(state.retired)) {
      side.marks.mark([{ rollout_id: rollout, attempt }]);
    }
    side.adopt?.(state.extra);
    const unsubscribe = [side.gate.onChange(() => this.#changed())];
    if (side.onChange) unsubscribe.push(side.onChange(() => this.#changed()));
    this.#unsubscribe = () => unsubscribe.forEach((stop) => stop());
    if (!state.accepting && state.request) {
      // A checkpoint is open: close at once and report, as every other worker did.
      this.#generation = state.generation;
      await this.#close(state.request);
      this.#changed();
    }
  }

  /** Sends a kind message to the coordinator. */
  call(
    kind: string,
    body: unknown,
    timeoutMs = MESSAGE_TIMEOUT_MS,
  ): Promise<JsonValue | WithBytes> {
    if (!this.#channel) {
      return Promise.reject(
        new CoordinatorUnavailableError(
          `this worker is not linked to its ${this.#label} coordinator`,
        ),
      );
    }
    return this.#channel.call(kind, body, timeoutMs);
  }

  /** The control routes' target: every call goes to the coordinator's plane. */
  controlTarget(): ControlTarget {
    const forward = (forwarded: ForwardedControl, timeoutMs: number): Promise<object> =>
      this.call('control', forwarded, timeoutMs) as Promise<object>;
    return {
      status: () => forward({ route: 'status', body: null }, MESSAGE_TIMEOUT_MS),
      // The coordinator answers a route with its HTTP reply's text (`runForwarded`).
      call: async (route, body, _signal, trace = {}) => {
        const reply = await forward(
          { route, body: body as JsonValue, trace },
          forwardTimeoutMs(body),
        );
        return reply instanceof WithBytes ? new EncodedReply(reply.bytes) : reply;
      },
      metrics: () =>
        forward({ route: 'metrics', body: null }, MESSAGE_TIMEOUT_MS) as Promise<MetricsJson>,
    };
  }

  /** A clean stop: tells the coordinator, then closes the connection (not reported as lost). */
  async detach(): Promise<void> {
    if (this.#stopping) return;
    this.#stopping = true;
    this.#unsubscribe?.();
    const channel = this.#channel;
    if (!channel || channel.closed) return;
    try {
      await channel.call('leave', {}, MESSAGE_TIMEOUT_MS);
    } catch {
      // The coordinator is gone already; nothing to tell.
    }
    channel.close();
  }

  async #connect(): Promise<Socket> {
    const deadline = Date.now() + (this.#options.connectTimeoutMs ?? MESSAGE_TIMEOUT_MS);
    for (;;) {
      try {
        return await connectOnce(this.#options.socketPath);
      } catch (err) {
        if (Date.now() >= deadline) {
          throw new CoordinatorUnavailableError(
            `no ${this.#label} checkpoint coordinator at ${this.#options.socketPath}: ${String(err)}`,
          );
        }
        await new Promise((resolve) => setTimeout(resolve, 50));
      }
    }
  }

  #lost(): void {
    if (this.#stopping || this.#closed) return;
    this.#closed = true;
    this.#options.logger.error(
      `lost the ${this.#label} checkpoint coordinator; stopping this worker`,
      { worker: this.#options.index },
    );
    (this.#options.onCoordinatorLost ?? (() => process.exit(1)))();
  }

  async #handle(kind: string, body: JsonValue, bytes?: Uint8Array): Promise<unknown> {
    const side = this.#side!;
    const b = body as JsonObject;
    switch (kind) {
      case 'close':
        this.#generation = b.generation as number;
        await this.#close(b.request as unknown as WorkerAdmissionRequest);
        return this.#numbered();
      case 'open':
        await (side.open ? side.open(b) : side.gate.open());
        return {};
      case 'mark':
        side.marks.mark((b.episode_ids as JsonValue[]).map((e) => episodeIdFromJson(e)));
        return {};
      case 'retire': {
        const episode = episodeIdFromJson(b.episode_id);
        await (side.retire ? side.retire(episode) : side.gate.retire(episode));
        return {};
      }
      case 'forget': {
        const ids = b.rollout_ids as string[];
        if (side.forget) await side.forget(ids);
        else side.marks.forget(ids);
        return {};
      }
      default:
        if (!side.handle) throw new Error(`unknown checkpoint message ${kind}`);
        return side.handle(kind, body, bytes);
    }
  }

  async #close(request: WorkerAdmissionRequest): Promise<void> {
    const side = this.#side!;
    await (side.close ? side.close(request) : side.gate.close());
  }

  #numbered(): NumberedReport {
    const side = this.#side!;
    this.#seq += 1;
    return {
      seq: this.#seq,
      report: { gate: side.gate.snapshot(), extra: side.reportExtra?.() ?? {} },
    };
  }

  /** While admission is closed, reports after every change, coalescing bursts into one message. */
  #changed(): void {
    if (!this.#reporting()) return;
    this.#reportPending = true;
    if (!this.#reportRunning) void this.#sendReports();
  }

  /** Reports are due while admission is closed and the link is up. */
  #reporting(): boolean {
    return !this.#side!.gate.isOpen && !this.#stopping && !!this.#channel && !this.#channel.closed;
  }

  /**
   * Sends the newest report until one is delivered. A failed push is sent again (newest state,
   * after a pause): the coordinator keeps no other copy, so a lost one would leave this worker
   * unreported, or reported busy, for the rest of the checkpoint.
   */
  async #sendReports(): Promise<void> {
    this.#reportRunning = true;
    let failures = 0;
    try {
      while (this.#reportPending && this.#reporting()) {
        this.#reportPending = false;
        const generation = this.#generation;
        try {
          await this.#channel!.call('report', { generation, ...this.#numbered() });
          failures = 0;
        } catch (err) {
          if (failures === 0) this.#reportFailed(err);
          failures += 1;
          this.#reportPending = true;
          await new Promise((resolve) => setTimeout(resolve, reportRetryDelayMs(failures)));
        }
      }
    } finally {
      this.#reportRunning = false;
    }
  }

  #reportFailed(err: unknown): void {
    this.#options.logger.warn(
      `could not report to the ${this.#label} checkpoint coordinator; sending it again`,
      { error: isCkptGymError(err) ? err.message : String(err) },
    );
  }
}
