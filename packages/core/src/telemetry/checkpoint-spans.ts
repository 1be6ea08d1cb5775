/**
 * The checkpoint's spans, named as NeMo Gym's `telemetry.py` names them so dashboards written for
 * it fit: `gym.checkpoint.<operation>` on each participant (one server span per control call, its
 * parent the controller's context from `traceparent`), with a child per slow step the control
 * plane timed (`tracingObserver`), and `gym.checkpoint.coordinate.<operation>` in the controller
 * with a child per stage it calls in turn.
 */
import { context, type Span, SpanKind, trace } from '@opentelemetry/api';

import type { ControlObserver, OperationEvent, StageName } from '../control/observer.js';
import { callerContext, gymTracer, inSpan, tracingOn } from './tracing.js';

export const ATTR_CHECKPOINT_ID = 'nemo.gym.checkpoint.id';
export const ATTR_KIND = 'nemo.gym.checkpoint.participant_kind';
export const ATTR_INSTANCE = 'nemo.gym.checkpoint.instance';
export const ATTR_RECORDS = 'nemo.gym.checkpoint.records';
export const ATTR_BYTES = 'nemo.gym.checkpoint.bytes';
export const ATTR_PHASE = 'nemo.gym.checkpoint.phase';
/** `ok`, or the stable code the operation failed with. */
export const ATTR_OUTCOME = 'nemo.gym.checkpoint.outcome';
/** restore: the checkpoint it read. */
export const ATTR_SOURCE_ID = 'nemo.gym.checkpoint.source_id';
/** Process CPU during the span (every thread), ms. */
export const ATTR_CPU_MS = 'nemo.gym.checkpoint.cpu_ms';
/** A controller stage: the participant kind it calls. */
export const ATTR_STAGE = 'nemo.gym.checkpoint.stage';
/** A controller span: how many participants it called. */
export const ATTR_PARTICIPANTS = 'nemo.gym.checkpoint.participants';
/** A controller prepare: whether every participant was prepared. */
export const ATTR_PREPARED = 'nemo.gym.checkpoint.prepared';

/** `gym.checkpoint.<operation>`: a participant's control call. */
export function operationSpanName(operation: string): string {
  return `gym.checkpoint.${operation}`;
}

/** `gym.checkpoint.coordinate.<operation>`: the controller's side of it. */
export function coordinateSpanName(operation: string): string {
  return `gym.checkpoint.coordinate.${operation}`;
}

/** Stage names telemetry.py has its own span for; the others keep the plane's name. */
const PYTHON_STAGE_NAMES: Partial<Record<StageName, string>> = {
  readiness_wait: 'wait_ready',
  records_write: 'write',
};

/** The span of a stage the control plane timed: `gym.checkpoint.wait_ready`, `.export`, … */
export function stageSpanName(stage: StageName): string {
  return `gym.checkpoint.${PYTHON_STAGE_NAMES[stage] ?? stage}`;
}

/** Who a participant is, for its spans. */
export interface ParticipantIdentity {
  readonly kind: string;
  readonly instance: string;
}

/**
 * Runs one control call in its `gym.checkpoint.<operation>` server span, a child of the caller's
 * trace context (`headers`); `tracingObserver` adds the stages and counts to it.
 */
export function inOperationSpan<T>(
  operation: string,
  who: ParticipantIdentity,
  checkpointId: string,
  headers: Record<string, unknown>,
  work: () => Promise<T>,
): Promise<T> {
  if (!tracingOn()) return work();
  const attributes = {
    [ATTR_CHECKPOINT_ID]: checkpointId,
    [ATTR_KIND]: who.kind,
    [ATTR_INSTANCE]: who.instance,
  };
  return inSpan(
    operationSpanName(operation),
    { kind: SpanKind.SERVER, attributes },
    work,
    callerContext(headers),
  );
}

/**
 * The stages of an operation that just ended, as children of `span`: the plane timed them back to
 * back from the operation's start, so they are laid out from there, none past `endedAt`. Times are
 * `performance.now()` readings, which the SDK maps onto its own clock.
 */
function addStageSpans(span: Span, event: OperationEvent, endedAt: number): void {
  const tracer = gymTracer();
  if (tracer === undefined) return;
  const parent = trace.setSpan(context.active(), span);
  let at = event.started_at;
  for (const stage of event.stages) {
    const child = tracer.startSpan(
      stageSpanName(stage.name),
      { startTime: at, attributes: { [ATTR_CPU_MS]: stage.cpu_ms } },
      parent,
    );
    at = Math.min(at + stage.ms, endedAt);
    child.end(at);
  }
}

function recordOperation(event: OperationEvent): void {
  const span = trace.getActiveSpan();
  if (span === undefined || !span.isRecording()) return;
  addStageSpans(span, event, performance.now());
  span.setAttributes({
    [ATTR_OUTCOME]: event.outcome,
    [ATTR_PHASE]: event.phase,
    [ATTR_RECORDS]: event.episodes,
    [ATTR_CPU_MS]: event.cpu_ms,
    ...(event.bytes === undefined ? {} : { [ATTR_BYTES]: event.bytes }),
    ...(event.source_checkpoint_id === undefined
      ? {}
      : { [ATTR_SOURCE_ID]: event.source_checkpoint_id }),
  });
}

/**
 * The control plane's observer for traces: each operation's stages become children of the control
 * call's span and its counts its attributes; a refusal names its code on the span. It reads the
 * active span, so it costs one check while tracing is off.
 */
export function tracingObserver(): ControlObserver {
  return {
    onOperation(event) {
      if (tracingOn()) recordOperation(event);
    },
    // The span's error status comes from the call failing (inSpan); this names its code.
    onRefused(event) {
      if (tracingOn()) trace.getActiveSpan()?.setAttribute(ATTR_OUTCOME, event.code);
    },
  };
}

/**
 * The controller's `gym.checkpoint.coordinate.<operation>` span around `work` (the participants'
 * spans hang under it, or under its stages).
 */
export function inCoordinateSpan<T>(
  operation: string,
  checkpointId: string,
  participants: number,
  work: (span: Span | undefined) => Promise<T>,
): Promise<T> {
  if (!tracingOn()) return work(undefined);
  const attributes = { [ATTR_CHECKPOINT_ID]: checkpointId, [ATTR_PARTICIPANTS]: participants };
  return inSpan(coordinateSpanName(operation), { attributes }, work);
}

/** One stage of a staged operation (prepare, resume, retire, forget): the kinds it calls at once. */
export function inStageSpan<T>(
  operation: string,
  kinds: readonly string[],
  participants: number,
  work: (span: Span | undefined) => Promise<T>,
): Promise<T> {
  if (!tracingOn()) return work(undefined);
  const stage = kinds.join('+');
  const attributes = { [ATTR_STAGE]: stage, [ATTR_PARTICIPANTS]: participants };
  return inSpan(`${coordinateSpanName(operation)}.${stage}`, { attributes }, work);
}
