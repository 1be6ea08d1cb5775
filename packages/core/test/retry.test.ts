import { once } from 'node:events';
import type { Server } from 'node:http';
import type { AddressInfo } from 'node:net';

import express from 'express';

import {
  AdmissionClosedError,
  type CkptGymError,
  DeadlineExceededError,
  ERROR_CATALOGUE,
  type ErrorCode,
  InvalidRequestError,
  StaleAttemptError,
  UpstreamError,
  retryRule,
  shouldRetry,
} from '../src/errors.js';
import { sendError } from '../src/express.js';

const servers: Server[] = [];

afterEach(() => {
  for (const server of servers.splice(0)) {
    server.closeAllConnections();
    server.close();
  }
});

/** A server answering `GET /<code>` with `sendError` of that refusal. */
async function refusals(errors: CkptGymError[]): Promise<string> {
  const app = express();
  for (const err of errors) app.get(`/${err.code}`, (_req, res) => sendError(res, err));
  const server = app.listen(0, '127.0.0.1');
  servers.push(server);
  await once(server, 'listening');
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
}

describe('the retry rule', () => {
  test('each code has one rule: refusals that cannot succeed never, admission after resume, transient failures with backoff', () => {
    const rules = Object.fromEntries(
      (Object.keys(ERROR_CATALOGUE) as ErrorCode[]).map((code) => [code, retryRule(code)]),
    );
    expect(rules).toEqual({
      checkpoint_error: 'never',
      stale_checkpoint: 'never',
      checkpoint_conflict: 'never',
      invalid_phase: 'never',
      deadline_exceeded: 'backoff',
      checkpoint_coordinator_unavailable: 'backoff',
      export_failed: 'never',
      restart_in_scope: 'never',
      retire_incomplete: 'never',
      stale_attempt: 'never',
      admission_closed: 'after_resume',
      activation_out_of_order: 'never',
      rollout_id_required: 'never',
      invalid_rollout_id: 'never',
      unauthorized: 'never',
      not_found: 'never',
      rollout_retired: 'never',
      invalid_checkpoint_state: 'never',
      invalid_request: 'never',
      payload_too_large: 'never',
      invalid_config: 'never',
      internal_error: 'backoff',
      upstream_error: 'backoff',
      malformed_request: 'never',
      headers_too_large: 'never',
      overloaded: 'backoff',
    });
  });

  test('shouldRetry is false for never and true for after_resume and backoff', () => {
    expect(
      (['stale_attempt', 'admission_closed', 'deadline_exceeded', 'upstream_error'] as const).map(
        shouldRetry,
      ),
    ).toEqual([false, true, true, true]);
  });

  test('sendError sets x-should-retry from the rule on every error reply, whatever its status', async () => {
    const url = await refusals([
      new StaleAttemptError('attempt 0 of r was retired'),
      new InvalidRequestError('x: must be a string'),
      new AdmissionClosedError('a checkpoint is open'),
      new DeadlineExceededError('deadline passed'),
      new UpstreamError('the inference backend at http://127.0.0.1:1/v1 could not be reached'),
    ]);
    const replies = [];
    for (const code of [
      'stale_attempt',
      'invalid_request',
      'admission_closed',
      'deadline_exceeded',
      'upstream_error',
    ]) {
      const res = await fetch(`${url}/${code}`);
      const body = (await res.json()) as { error: { code: string } };
      replies.push([body.error.code, res.status, res.headers.get('x-should-retry')]);
    }
    expect(replies).toEqual([
      ['stale_attempt', 409, 'false'],
      ['invalid_request', 422, 'false'],
      ['admission_closed', 409, 'true'],
      ['deadline_exceeded', 409, 'true'],
      ['upstream_error', 502, 'true'],
    ]);
  });
});
