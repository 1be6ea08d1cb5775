/**
 * When a process traces (`tracingPlan`, the OTel spec's variables and the stack file's
 * `telemetry:` block), and that with tracing off nothing is traced or sent.
 */
import { once } from 'node:events';
import { createServer, type IncomingHttpHeaders } from 'node:http';
import type { AddressInfo } from 'node:net';

import { jest } from '@jest/globals';
import { diag, trace } from '@opentelemetry/api';

import { ConfigError } from '../../src/errors.js';
import { createHttpClients } from '../../src/http-client.js';
import { parseStackFile } from '../../src/settings.js';
import {
  DEFAULT_ROLLOUT_SAMPLE_RATIO,
  DEFAULT_TRACES_ENDPOINT,
  inSpan,
  samplerFromEnv,
  startTracing,
  startTracingFor,
  tracingOn,
  tracingPlan,
} from '../../src/telemetry/tracing.js';

const FILE = { tracesEndpoint: 'http://collector:4318/v1/traces', serviceName: 'my-stack' };

describe('tracingPlan', () => {
  it('is off when nothing asks for it, even with a service name', () => {
    expect(tracingPlan({}, undefined, 'env')).toBeUndefined();
    expect(tracingPlan({ OTEL_SERVICE_NAME: 'x' }, {}, 'env')).toBeUndefined();
    expect(tracingPlan({}, { serviceName: 'x' }, 'env')).toBeUndefined();
  });

  it('is on with the stack file’s endpoint, named by the file or else the server', () => {
    expect(tracingPlan({}, FILE, 'env')).toEqual({
      endpoint: FILE.tracesEndpoint,
      serviceName: 'my-stack',
      rolloutSampleRatio: DEFAULT_ROLLOUT_SAMPLE_RATIO,
    });
    expect(tracingPlan({}, { tracesEndpoint: FILE.tracesEndpoint }, 'env')?.serviceName).toBe(
      'env',
    );
  });

  it('takes the signal endpoint as is and appends /v1/traces to the base one; both beat the file', () => {
    const signal = 'http://a:4318/custom';
    expect(tracingPlan({ OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: signal }, FILE, 'env')?.endpoint).toBe(
      signal,
    );
    expect(
      tracingPlan({ OTEL_EXPORTER_OTLP_ENDPOINT: 'http://b:4318/' }, FILE, 'env')?.endpoint,
    ).toBe('http://b:4318/v1/traces');
    expect(
      tracingPlan(
        {
          OTEL_EXPORTER_OTLP_ENDPOINT: 'http://b:4318',
          OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: signal,
        },
        undefined,
        'env',
      )?.endpoint,
    ).toBe(signal);
  });

  it('OTEL_TRACES_EXPORTER=otlp alone is on at the spec’s default endpoint', () => {
    expect(tracingPlan({ OTEL_TRACES_EXPORTER: 'otlp' }, undefined, 'env')).toEqual({
      endpoint: DEFAULT_TRACES_ENDPOINT,
      serviceName: 'env',
      rolloutSampleRatio: DEFAULT_ROLLOUT_SAMPLE_RATIO,
    });
  });

  it('traces every rollout unless the file says how many; OTEL_TRACES_SAMPLER samples them as every span', () => {
    expect(DEFAULT_ROLLOUT_SAMPLE_RATIO).toBe(1);
    const ratio = (env: Record<string, string>, file: object = FILE) =>
      tracingPlan(env, file, 'env')?.rolloutSampleRatio;
    expect(ratio({})).toBe(1);
    expect(ratio({}, { ...FILE, rolloutSampleRatio: 0.25 })).toBe(0.25);
    expect(ratio({}, { ...FILE, rolloutSampleRatio: 0 })).toBe(0);
    const sampler = { OTEL_TRACES_SAMPLER: 'parentbased_always_off' };
    expect(ratio(sampler, { ...FILE, rolloutSampleRatio: 0 })).toBeUndefined();
    expect(ratio({ OTEL_TRACES_SAMPLER: ' ' }, { ...FILE, rolloutSampleRatio: 0 })).toBe(0);
  });

  it('OTEL_SERVICE_NAME names the service over the file', () => {
    expect(tracingPlan({ OTEL_SERVICE_NAME: 'svc' }, FILE, 'env')?.serviceName).toBe('svc');
  });

  it('OTEL_SDK_DISABLED=true and OTEL_TRACES_EXPORTER=none win over every endpoint', () => {
    const on = { OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: 'http://a:4318/v1/traces' };
    expect(tracingPlan({ ...on, OTEL_SDK_DISABLED: 'true' }, FILE, 'env')).toBeUndefined();
    expect(tracingPlan({ ...on, OTEL_SDK_DISABLED: 'TRUE' }, FILE, 'env')).toBeUndefined();
    expect(tracingPlan({ ...on, OTEL_TRACES_EXPORTER: 'none' }, FILE, 'env')).toBeUndefined();
    expect(tracingPlan({ ...on, OTEL_SDK_DISABLED: 'false' }, FILE, 'env')).toBeDefined();
  });

  it('refuses an exporter it does not have', () => {
    expect(() => tracingPlan({ OTEL_TRACES_EXPORTER: 'zipkin' }, FILE, 'env')).toThrow(ConfigError);
  });
});

describe('samplerFromEnv', () => {
  const named = (env: Record<string, string>) => samplerFromEnv(env).toString();

  it('builds the sampler OTEL_TRACES_SAMPLER names, parent-based always-on by default', () => {
    expect(named({})).toMatch(/^ParentBased\{root=AlwaysOnSampler,/);
    expect(named({ OTEL_TRACES_SAMPLER: 'always_off' })).toBe('AlwaysOffSampler');
    expect(named({ OTEL_TRACES_SAMPLER: 'always_on' })).toBe('AlwaysOnSampler');
    expect(named({ OTEL_TRACES_SAMPLER: 'parentbased_always_off' })).toMatch(
      /^ParentBased\{root=AlwaysOffSampler,/,
    );
  });

  it('says so through the OTel diag logger when OTEL_TRACES_SAMPLER names no sampler, and uses the default', () => {
    const error = jest.spyOn(diag, 'error').mockImplementation(() => {});
    try {
      expect(named({ OTEL_TRACES_SAMPLER: 'sometimes' })).toMatch(
        /^ParentBased\{root=AlwaysOnSampler,/,
      );
      expect(error).toHaveBeenCalledWith(expect.stringContaining('OTEL_TRACES_SAMPLER=sometimes'));
      error.mockClear();
      named({ OTEL_TRACES_SAMPLER: 'parentbased_always_on' });
      expect(error).not.toHaveBeenCalled();
    } finally {
      error.mockRestore();
    }
  });

  it('takes the ratio from OTEL_TRACES_SAMPLER_ARG, 1 when it is missing or out of range', () => {
    const ratio = {
      OTEL_TRACES_SAMPLER: 'parentbased_traceidratio',
      OTEL_TRACES_SAMPLER_ARG: '0.25',
    };
    expect(named(ratio)).toMatch(/^ParentBased\{root=TraceIdRatioBased\{0\.25\},/);
    expect(named({ OTEL_TRACES_SAMPLER: 'traceidratio', OTEL_TRACES_SAMPLER_ARG: '2' })).toBe(
      'TraceIdRatioBased{1}',
    );
    expect(named({ OTEL_TRACES_SAMPLER: 'traceidratio' })).toBe('TraceIdRatioBased{1}');
  });
});

describe('the telemetry: block', () => {
  const servers = 'servers:\n  m: { kind: model, app: policy, port: 1 }\n';

  it('is read into the stack’s telemetry settings; absent, it is empty', () => {
    const text = `telemetry:\n  service_name: gym\n  traces: { endpoint: "http://c:4318/v1/traces" }\n${servers}`;
    expect(parseStackFile(text).telemetry).toEqual({
      serviceName: 'gym',
      tracesEndpoint: 'http://c:4318/v1/traces',
    });
    expect(parseStackFile(servers).telemetry).toEqual({});
    const sampled = `telemetry:\n  traces: { rollout_sample_ratio: 0.25 }\n${servers}`;
    expect(parseStackFile(sampled).telemetry).toEqual({ rolloutSampleRatio: 0.25 });
  });

  it('refuses a rollout sample ratio outside 0 to 1', () => {
    for (const ratio of ['-0.1', '1.5', '"all"']) {
      expect(() =>
        parseStackFile(`telemetry:\n  traces: { rollout_sample_ratio: ${ratio} }\n${servers}`),
      ).toThrow(/rollout_sample_ratio/);
    }
  });

  it('refuses an unknown key with a suggestion, and an endpoint that is not an http URL', () => {
    expect(() => parseStackFile(`telemetry:\n  trace: {}\n${servers}`)).toThrow(
      /telemetry\.trace: unknown key \(allowed: service_name, traces\).*did you mean 'traces'/,
    );
    expect(() =>
      parseStackFile(`telemetry:\n  traces: { endpoint: "collector:4318" }\n${servers}`),
    ).toThrow(/telemetry\.traces\.endpoint/);
  });
});

describe('tracing off', () => {
  it('starts nothing, records nothing and sends no trace header', async () => {
    expect(startTracingFor({ service: 's', instance: 's' }, {}, {})).toBeUndefined();
    expect(tracingOn()).toBe(false);

    const seen: IncomingHttpHeaders[] = [];
    const server = createServer((req, res) => {
      seen.push(req.headers);
      res.end('{}');
    }).listen(0, '127.0.0.1');
    await once(server, 'listening');
    const clients = createHttpClients();
    try {
      const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/`;
      await inSpan('nothing', {}, async (span) => {
        expect(span).toBeUndefined();
        expect(trace.getActiveSpan()).toBeUndefined();
        await clients.data.post(url, { json: {} });
      });
    } finally {
      clients.close();
      server.close();
    }
    expect(seen).toHaveLength(1);
    expect(seen[0]!.traceparent).toBeUndefined();
  });
});

describe('shutdown', () => {
  it('never fails when the collector is unreachable: the last spans are dropped and tracing ends', async () => {
    // A port nothing listens on: take one, then close it.
    const taken = createServer().listen(0, '127.0.0.1');
    await once(taken, 'listening');
    const { port } = taken.address() as AddressInfo;
    taken.close();
    await once(taken, 'close');

    const tracing = startTracing({
      endpoint: `http://127.0.0.1:${port}/v1/traces`,
      serviceName: 'unreachable',
    });
    await inSpan('left to export', {}, async () => undefined);
    await expect(tracing.shutdown()).resolves.toBeUndefined();
    expect(tracingOn()).toBe(false);
  });
});
