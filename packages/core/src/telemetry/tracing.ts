/**
 * Tracing through the OpenTelemetry API. Off unless the standard `OTEL_*` variables or the stack
 * file's `telemetry:` block ask for it (`tracingPlan`, a pure rule); then one process-wide tracer
 * provider exports over OTLP/HTTP (JSON) in batches. While it is off every helper here returns at
 * its first line, and the API's own no-op tracer answers anything else: no span, no header.
 */
import {
  type Context,
  context,
  diag,
  propagation,
  type Span,
  type SpanOptions,
  SpanStatusCode,
  trace,
  type Tracer,
} from '@opentelemetry/api';
import { OTLPTraceExporter } from '@opentelemetry/exporter-trace-otlp-http';
import { detectResources, envDetector, resourceFromAttributes } from '@opentelemetry/resources';
import {
  AlwaysOffSampler,
  AlwaysOnSampler,
  BatchSpanProcessor,
  ParentBasedSampler,
  RandomIdGenerator,
  type Sampler,
  SimpleSpanProcessor,
  type SpanExporter,
  TraceIdRatioBasedSampler,
} from '@opentelemetry/sdk-trace-base';
import { NodeTracerProvider } from '@opentelemetry/sdk-trace-node';
import { ATTR_SERVICE_NAME } from '@opentelemetry/semantic-conventions';

import { ConfigError } from '../errors.js';
import type { Env, TelemetrySettings } from '../settings.js';
import { SpanBatch, type SpanRecorder } from './server-span.js';

/** The instrumentation scope of every span ckpt-gym makes. */
export const TRACER_NAME = 'ckpt-gym';
/** Where an OTLP/HTTP collector listens when only `OTEL_TRACES_EXPORTER=otlp` is set (the spec's default). */
export const DEFAULT_TRACES_ENDPOINT = 'http://localhost:4318/v1/traces';
/** The resource attribute naming which server of the stack a process is. */
export const ATTR_SERVICE_INSTANCE_ID = 'service.instance.id';

/** What a process traces with, once tracing is on. */
export interface TracingPlan {
  /** The OTLP/HTTP traces URL spans are posted to. */
  readonly endpoint: string;
  readonly serviceName: string;
  /**
   * The share of rollouts (traces begun by a data-plane request) whose request spans are
   * recorded; a caller's sampled flag is followed. Absent: the request spans are sampled as
   * every other span (`OTEL_TRACES_SAMPLER`, which sets it absent when it is set).
   */
  readonly rolloutSampleRatio?: number;
}

/**
 * The share of rollouts traced when neither the stack file nor `OTEL_TRACES_SAMPLER` says: every
 * one, as NeMo Gym's default span groups record every request. Measured on warm servers, recording
 * a tenth or a hundredth costs as much as recording all (docs/telemetry.md, Cost): a lower share
 * is for the volume a trace store keeps, not for CPU.
 */
export const DEFAULT_ROLLOUT_SAMPLE_RATIO = 1;

function isTrue(value: string | undefined): boolean {
  return value?.trim().toLowerCase() === 'true';
}

function nonEmpty(value: string | undefined): string | undefined {
  const trimmed = value?.trim();
  return trimmed ? trimmed : undefined;
}

/** `OTEL_EXPORTER_OTLP_ENDPOINT` is a base URL: the spec appends the signal's path to it. */
function tracesUrlOfBase(base: string): string {
  return `${base.replace(/\/+$/, '')}/v1/traces`;
}

/**
 * Whether and where this process traces, following the OTel spec's variables: `OTEL_SDK_DISABLED=true`
 * wins, then `OTEL_TRACES_EXPORTER=none`; an endpoint (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as is,
 * `OTEL_EXPORTER_OTLP_ENDPOINT` plus `/v1/traces`, else the stack file's `telemetry.traces.endpoint`)
 * or `OTEL_TRACES_EXPORTER=otlp` turns it on. Unlike the spec's SDK default, nothing set means off:
 * a gym server exports nowhere unless asked. `service.name`: `OTEL_SERVICE_NAME`, the file's
 * `telemetry.service_name`, else `defaultServiceName`.
 */
export function tracingPlan(
  env: Env,
  telemetry: TelemetrySettings | undefined,
  defaultServiceName: string,
): TracingPlan | undefined {
  if (isTrue(env.OTEL_SDK_DISABLED)) return undefined;
  const exporters = (env.OTEL_TRACES_EXPORTER ?? '')
    .split(',')
    .map((name) => name.trim().toLowerCase())
    .filter((name) => name !== '');
  if (exporters.includes('none')) return undefined;
  const unsupported = exporters.find((name) => name !== 'otlp');
  if (unsupported !== undefined) {
    throw new ConfigError(
      `OTEL_TRACES_EXPORTER=${env.OTEL_TRACES_EXPORTER}: ckpt-gym exports traces only with otlp (or none)`,
    );
  }
  const base = nonEmpty(env.OTEL_EXPORTER_OTLP_ENDPOINT);
  const endpoint =
    nonEmpty(env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) ??
    (base === undefined ? undefined : tracesUrlOfBase(base)) ??
    telemetry?.tracesEndpoint;
  if (endpoint === undefined && !exporters.includes('otlp')) return undefined;
  return {
    endpoint: endpoint ?? DEFAULT_TRACES_ENDPOINT,
    serviceName: nonEmpty(env.OTEL_SERVICE_NAME) ?? telemetry?.serviceName ?? defaultServiceName,
    ...(nonEmpty(env.OTEL_TRACES_SAMPLER) === undefined
      ? { rolloutSampleRatio: telemetry?.rolloutSampleRatio ?? DEFAULT_ROLLOUT_SAMPLE_RATIO }
      : {}),
  };
}

/** `OTEL_TRACES_SAMPLER_ARG` as a ratio: the spec's default 1 when it is missing or out of range. */
function samplerRatio(arg: string | undefined): number {
  const ratio = Number(nonEmpty(arg) ?? Number.NaN);
  return ratio >= 0 && ratio <= 1 ? ratio : 1;
}

/**
 * The sampler `OTEL_TRACES_SAMPLER` (and `OTEL_TRACES_SAMPLER_ARG`) name, as the SDK builds it
 * from them (default `parentbased_always_on`); built here once so the SDK's spans and the request
 * spans (`server-span.ts`) share it.
 */
export function samplerFromEnv(env: Env): Sampler {
  const ratio = () => new TraceIdRatioBasedSampler(samplerRatio(env.OTEL_TRACES_SAMPLER_ARG));
  const name = nonEmpty(env.OTEL_TRACES_SAMPLER)?.toLowerCase();
  switch (name) {
    case 'always_on':
      return new AlwaysOnSampler();
    case 'always_off':
      return new AlwaysOffSampler();
    case 'traceidratio':
      return ratio();
    case 'parentbased_always_off':
      return new ParentBasedSampler({ root: new AlwaysOffSampler() });
    case 'parentbased_traceidratio':
      return new ParentBasedSampler({ root: ratio() });
    default:
      if (name !== undefined && name !== 'parentbased_always_on') {
        diag.error(`OTEL_TRACES_SAMPLER=${name} is not a sampler: parentbased_always_on instead`);
      }
      return new ParentBasedSampler({ root: new AlwaysOnSampler() });
  }
}

/**
 * The sampler of the request spans: the plan's share of rollouts, by trace id, where a trace
 * begins, and the caller's decision under it; without a share, the process's own `sampler`.
 * Checkpoint spans always go through the process's sampler (default: every one).
 */
function requestSampler(plan: TracingPlan, sampler: Sampler): Sampler {
  const ratio = plan.rolloutSampleRatio;
  if (ratio === undefined) return sampler;
  // The SDK's ratio sampler at 1 still drops one trace id in 2^32: every one means every one.
  const root = ratio >= 1 ? new AlwaysOnSampler() : new TraceIdRatioBasedSampler(ratio);
  return new ParentBasedSampler({ root });
}

/** The running tracing of this process. */
export interface Tracing {
  readonly serviceName: string;
  /**
   * Exports what is left and turns tracing off again (the API back to its no-op tracer). Never
   * fails: with the collector unreachable the last spans are dropped (reported through the OTel
   * diag logger, `OTEL_LOG_LEVEL`), and the command or server ends as it would have.
   */
  shutdown(): Promise<void>;
}

export interface StartTracingOptions {
  /** `service.instance.id`: the server's name in the stack file, or the CLI's. */
  readonly instance?: string;
  /** Replaces the OTLP exporter, each span exported as it ends (tests: `InMemorySpanExporter`). */
  readonly exporter?: SpanExporter;
}

let running: { tracing: Tracing; tracer: Tracer; recorder: SpanRecorder } | undefined;

/** Whether this process traces: the one check every hot-path helper makes first. */
export function tracingOn(): boolean {
  return running !== undefined;
}

/**
 * Registers the process's tracer provider (W3C `traceparent`/`tracestate` propagation, async
 * context), or returns the one already running. Batches follow `OTEL_BSP_*`.
 */
export function startTracing(plan: TracingPlan, options: StartTracingOptions = {}): Tracing {
  if (running !== undefined) return running.tracing;
  const resource = resourceFromAttributes({
    [ATTR_SERVICE_NAME]: plan.serviceName,
    ...(options.instance === undefined ? {} : { [ATTR_SERVICE_INSTANCE_ID]: options.instance }),
  }).merge(detectResources({ detectors: [envDetector] }));
  const processor = options.exporter
    ? new SimpleSpanProcessor(options.exporter)
    : new BatchSpanProcessor(new OTLPTraceExporter({ url: plan.endpoint }));
  const sampler = samplerFromEnv(process.env);
  const provider = new NodeTracerProvider({ resource, sampler, spanProcessors: [processor] });
  provider.register();
  const scope = { name: TRACER_NAME, version: undefined, schemaUrl: undefined };
  const requests = requestSampler(plan, sampler);
  const recorder = {
    resource,
    scope,
    sampler: requests,
    followsParent: requests instanceof ParentBasedSampler,
    processor,
    ids: new RandomIdGenerator(),
    batch: new SpanBatch(),
  };
  const { batch } = recorder;
  const tracing: Tracing = {
    serviceName: plan.serviceName,
    async shutdown() {
      if (running?.tracing !== tracing) return;
      running = undefined;
      batch.flush();
      try {
        await provider.shutdown();
      } catch (err) {
        diag.warn(`ckpt-gym: the last spans were not exported: ${String(err)}`);
      } finally {
        trace.disable();
        context.disable();
        propagation.disable();
      }
    },
  };
  running = { tracing, tracer: trace.getTracer(TRACER_NAME), recorder };
  return tracing;
}

/**
 * Starts tracing when `tracingPlan` says so (`service` names the process when nothing else does);
 * undefined when it stays off.
 */
export function startTracingFor(
  who: { readonly service: string; readonly instance: string },
  telemetry: TelemetrySettings | undefined,
  env: Env = process.env,
): Tracing | undefined {
  const plan = tracingPlan(env, telemetry, who.service);
  return plan === undefined ? undefined : startTracing(plan, { instance: who.instance });
}

/** Exports what is left and ends this process's tracing, if any (before it exits). */
export async function stopTracing(): Promise<void> {
  await running?.tracing.shutdown();
}

/** Marks `span` failed with `err`'s message (and the exception as an event). */
function failSpan(span: Span, err: unknown): void {
  span.recordException(err instanceof Error ? err : String(err));
  span.setStatus({
    code: SpanStatusCode.ERROR,
    message: err instanceof Error ? err.message : String(err),
  });
}

/**
 * Runs `work` in a span that is the active one meanwhile (its children, and the trace context of
 * outgoing calls, hang under it), ended when the work settles; a throw marks it failed. While
 * tracing is off it only runs `work`.
 */
export async function inSpan<T>(
  name: string,
  options: SpanOptions,
  work: (span: Span | undefined) => Promise<T>,
  parent = context.active(),
): Promise<T> {
  if (running === undefined) return work(undefined);
  return running.tracer.startActiveSpan(name, options, parent, async (span) => {
    try {
      return await work(span);
    } catch (err) {
      failSpan(span, err);
      throw err;
    } finally {
      span.end();
    }
  });
}

/**
 * The context a served call runs in: its caller's trace context from `headers` (`traceparent`),
 * over the active context's other values (the request's scope), never the span the server happened
 * to be started in.
 */
export function callerContext(headers: Record<string, unknown>): Context {
  const active = context.active();
  // A request's work starts from the root and its scope, spanless: no copy to take a span out.
  const spanless = trace.getSpan(active) === undefined ? active : trace.deleteSpan(active);
  return propagation.extract(spanless, headers);
}

/** What request spans (`server-span.ts`) are recorded with while tracing is on. */
export function spanRecorder(): SpanRecorder | undefined {
  return running?.recorder;
}

/** The tracer while tracing is on. */
export function gymTracer(): Tracer | undefined {
  return running?.tracer;
}
