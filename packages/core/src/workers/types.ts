/**
 * The public types of the worker-coordination layer: a server with several worker processes is
 * still one checkpoint participant. The primary process runs the coordinator (`WorkerCoordinator`,
 * the participant its control plane wraps) and serves no HTTP; each worker serves requests on the
 * shared port, runs its own admission gate (`WorkerSide`) and talks to the coordinator over one
 * Unix-socket channel (`Channel`). docs/workers.md has the design and the failure rules.
 */
import type { AdmissionGate, GateSnapshot } from '../admission/gate.js';
import type { EpisodeId } from '../identity.js';
import type { JsonObject, JsonValue } from '../json.js';
import type { PrepareReport, RetiredMarks } from '../participant.js';

/** A request on the channel: `id` is unique per direction of one connection. */
export interface ChannelRequest {
  readonly id: number;
  readonly kind: string;
  readonly body: JsonValue;
}

/** The typed error a reply carries: the error catalogue's status and code, and the detail. */
export interface ChannelError {
  readonly status: number;
  readonly code: string;
  readonly detail: string;
}

/** The reply to request `reply_to`. */
export type ChannelReply =
  | { readonly reply_to: number; readonly ok: true; readonly body: unknown }
  | { readonly reply_to: number; readonly ok: false; readonly error: ChannelError };

export type ChannelMessage = ChannelRequest | ChannelReply;

/**
 * Serves one request kind and body (and the bytes sent beside it, if any); a thrown typed error is
 * the caller's typed error. Sent bodies and replies are anything the faithful codec writes
 * (checked when framed).
 */
export type ChannelHandler = (
  kind: string,
  body: JsonValue,
  bytes?: Uint8Array,
) => Promise<unknown>;
/**
 * Serves a request on the read loop, before any later frame of the connection is read (so its
 * reply precedes every later message: claims), or returns undefined to leave it to the handler.
 */
export type ImmediateHandler = (kind: string, body: JsonValue) => unknown;

/** What a worker tells the coordinator about itself when it joins (`join`). */
export interface WorkerRegistration {
  /** The worker's index among the server's workers, from 1 (given by the primary at fork). */
  readonly index: number;
  readonly pid: number;
  /** What its kind adds (`WorkerSide.registration`). */
  readonly extra: JsonObject;
}

/** A worker's readiness, as it reports it: its gate's snapshot and what its kind adds. */
export interface WorkerReport {
  readonly gate: GateSnapshot;
  readonly extra: JsonObject;
}

/** A report with its worker's sequence number (newest wins: reply and push paths can reorder). */
export interface NumberedReport {
  readonly seq: number;
  readonly report: WorkerReport;
}

/** The admission request as a worker gets it (restarts as of the close). */
export interface WorkerAdmissionRequest {
  readonly checkpoint_id: string;
  readonly deadline_ts: number;
  readonly carried_restarts: string[];
}

/** The state a joining worker adopts (`join`'s reply). */
export interface JoinState {
  readonly accepting: boolean;
  /** Increments at each close: a report of an earlier generation is ignored. */
  readonly generation: number;
  /** The open checkpoint's admission request, when admission is closed. */
  readonly request: WorkerAdmissionRequest | null;
  /** Retired marks: rollout id → highest retired attempt (a late joiner refuses them too). */
  readonly retired: Record<string, number>;
  /** What the coordinator's kind adds (`WorkerCoordinator.joinState`). */
  readonly extra: JsonObject;
}

/** One worker as the coordinator knows it (what a kind's hooks are told). */
export interface WorkerInfo {
  readonly index: number;
  readonly pid: number;
  readonly registration: WorkerRegistration;
  /** Its newest report of the current generation, or null. */
  readonly report: WorkerReport | null;
}

/** A worker as `status` lists it. */
export interface WorkerStatus {
  readonly index: number;
  readonly pid: number;
  /** Reported ready for the current checkpoint (false while admission is open: nothing reported). */
  readonly ready: boolean;
}

/**
 * The message kinds the layer itself uses. Coordinator → worker: `close`, `open`, `mark`,
 * `retire`, `forget`; worker → coordinator: `join`, `report`, `control`, `leave`. Any other kind
 * is a kind message (`WorkerCoordinator.handle` / `handleNow`, `WorkerSide.handle`).
 */
export const LAYER_MESSAGES = [
  'close',
  'open',
  'mark',
  'retire',
  'forget',
  'join',
  'report',
  'control',
  'leave',
] as const;
export type LayerMessage = (typeof LAYER_MESSAGES)[number];

/**
 * One worker's share of a participant, driven by the coordinator: a kind hands it to its worker
 * link (`WorkerContext.attach`). Each hook is optional; the default acts on `gate` (close, open,
 * retire) and `marks` (mark, forget) only.
 */
export interface WorkerSide {
  /** This worker's admission gate: its `snapshot()` is the report, `onChange` sends a fresh one. */
  readonly gate: AdmissionGate;
  /** The marks this worker's data plane refuses retired attempts by. */
  readonly marks: RetiredMarks;
  /** Closes this worker's admission for a checkpoint (default `gate.close()`). */
  close?(request: WorkerAdmissionRequest): Promise<void>;
  /** Reopens it, adopting the coordinator's `openState` (default `gate.open()`). */
  open?(state: JsonObject): Promise<void>;
  /** Stops the attempt and earlier ones on this worker (default `gate.retire(episode)`). */
  retire?(episode: EpisodeId): Promise<void>;
  /** Forgets the rollouts' marks here and what else the kind keeps (default `marks.forget`). */
  forget?(rolloutIds: readonly string[]): Promise<void>;
  /** Adopts the coordinator's kind join state (`JoinState.extra`). */
  adopt?(state: JsonObject): void;
  /** What the kind adds to the registration. */
  registration?(): JsonObject;
  /** What the kind adds to each report (`WorkerReport.extra`). */
  reportExtra?(): JsonObject;
  /**
   * Subscribes to changes of what `reportExtra` says beyond the gate (a participant's readiness):
   * each sends a fresh report while admission is closed, as a gate change does.
   */
  onChange?(listener: () => void): () => void;
  /** Serves a kind message from the coordinator (with the bytes sent beside it, if any). */
  handle?(kind: string, body: JsonValue, bytes?: Uint8Array): Promise<unknown>;
}

/**
 * What a kind's coordinator (a `WorkerCoordinator` subclass, in the primary process) adds to the
 * layer: how its workers' reports merge, the state a worker adopts on joining and on reopening,
 * and its own messages. Export, install, restored attempts and the rest are the `Participant`
 * contract, which the subclass implements with `broadcast` / `callEach` to reach its workers.
 */
export interface CoordinatorHooks {
  /**
   * One report out of the workers' reports (blockers, counts, restarts). Pure; its result is kept
   * until the next `notifyChange`, so other state it reads must call `notifyChange` when it changes.
   */
  merge(reports: readonly WorkerReport[]): PrepareReport;
  /** Kind state a joining worker adopts (`JoinState.extra`, `WorkerSide.adopt`). */
  joinState?(worker: WorkerInfo): JsonObject;
  /** Kind state every worker adopts on reopening (`WorkerSide.open`). */
  openState?(): JsonObject;
  /** Serves a kind message from a worker. */
  handle?(worker: WorkerInfo, kind: string, body: JsonValue): Promise<unknown>;
  /** Serves a kind message on the read loop, before any later message of that worker; or undefined. */
  handleNow?(worker: WorkerInfo, kind: string, body: JsonValue): unknown;
}

/** Time for messages that do no slow work (join, reports, marks, reopening, claims). */
export const MESSAGE_TIMEOUT_MS = 30_000;
/** How long past a control call's own deadline a worker waits for the coordinator's reply. */
export const REPLY_GRACE_MS = 10_000;
/** The environment variables through which the primary hands each forked worker its link. */
export const COORDINATOR_SOCKET_ENV = 'CKPT_GYM_COORDINATOR_SOCKET';
export const WORKER_INDEX_ENV = 'CKPT_GYM_WORKER_INDEX';
/** The server's runtime directory, where each worker serves its own socket (session routing). */
export const RUNTIME_DIR_ENV = 'CKPT_GYM_RUNTIME_DIR';
