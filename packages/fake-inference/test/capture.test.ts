import { buildInventory, parseCommitCoords, rootCaptureAdmission } from '@ckpt-gym/core/capture';
import { until } from '@ckpt-gym/testing';

import { type RunningFakeInference, startFakeInference } from '../src/app.js';
import type { CallView } from '../src/calls.js';

let fake: RunningFakeInference;

beforeEach(async () => {
  fake = await startFakeInference();
});

afterEach(async () => {
  fake.server.closeAllConnections();
  await fake.close();
});

const USER = { role: 'user', content: 'What is the weather in SF?' };

function admission(id: string, extra: object = {}) {
  return { ...rootCaptureAdmission('r', id), ...extra };
}

async function post(
  path: string,
  body: unknown,
): Promise<{ status: number; body: Record<string, unknown> }> {
  const res = await fetch(`${fake.url}${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
  return { status: res.status, body: (await res.json()) as Record<string, unknown> };
}

const chat = (ngCapture: unknown) =>
  post('/ng-rollout/r/v1/chat/completions', { messages: [USER], ng_capture: ngCapture });

async function calls(): Promise<CallView[]> {
  const res = await fetch(`${fake.url}/_ctl/calls`);
  return ((await res.json()) as { calls: CallView[] }).calls;
}

function cut(id: string, checkpoint = 'ck') {
  return post(
    '/ng-control/v1/generation-cut',
    buildInventory(checkpoint, 'policy', [
      { ticket_id: `t-${id}`, rollout_id: 'r', attempt: 0, model_call_id: id, admitted_at: 1.5 },
    ]),
  );
}

describe('worker staging in the fake backend', () => {
  test('a captured call is staged and answers its commit coordinates', async () => {
    const reply = await chat(admission('c1'));
    expect(reply.status).toBe(200);
    const coords = parseCommitCoords(reply.body.ng_commit_coords);
    expect(coords).toMatchObject({ disposition: 'staged', staging_key: 'r/c1', prev_len: 0 });
    expect(fake.state.tokens.stagedRecord('r/c1')?.digest).toBe(coords.digest);
  });

  test('an invalid admission stages nothing: capture_failed coordinates and the reason in the log', async () => {
    const reply = await chat(admission('c1', { mode: 'token_in' }));
    expect(reply.status).toBe(200);
    expect(reply.body.ng_commit_coords).toMatchObject({ disposition: 'capture_failed' });
    expect((await calls())[0]).toMatchObject({ capture_error: 'invalid_admission' });
    expect(fake.state.tokens.stagedCount).toBe(0);
  });

  test('the cut route cuts a call still in flight at the tokens generated so far', async () => {
    await post('/_ctl/hold', { after_calls: 0, after_tokens: 2 });
    const held = chat(admission('c1'));
    await until(() => fake.state.active.has('c1'), 'call c1 to be active');
    const receipt = await cut('c1');
    expect(receipt.status).toBe(200);
    expect(receipt.body.prefixes).toEqual([
      expect.objectContaining({
        disposition: 'durable_prefix',
        prefix_token_count: 2,
        staging_keys: ['__generation_cut__/r/c1/0'],
      }),
    ]);
    expect(fake.state.tokens.cutRounds()).toEqual([['c1']]);
    await post('/_ctl/release', {});
    expect((await held).status).toBe(200);
  });

  test('a held call that generated nothing yet is not cut (regenerating it costs nothing)', async () => {
    await post('/_ctl/hold', { after_calls: 0 });
    const held = chat(admission('c1'));
    await until(() => fake.state.active.has('c1'), 'call c1 to be active');
    const receipt = await cut('c1');
    expect(receipt.body.prefixes).toEqual([
      expect.objectContaining({ disposition: 'durable_failure' }),
    ]);
    expect(fake.state.tokens.cutRounds()).toEqual([[]]);
    await post('/_ctl/release', {});
    await held;
  });

  test('a replacement call continues a cut and records continued_from and reused_prefix_tokens', async () => {
    await post('/_ctl/hold', { after_calls: 0, after_tokens: 2 });
    const held = chat(admission('c1'));
    await until(() => fake.state.active.has('c1'), 'call c1 to be active');
    const ack = ((await cut('c1')).body.prefixes as Record<string, unknown>[])[0]!;
    await post('/_ctl/release', {});
    await held;
    const continuation = {
      schema_version: 2,
      source_capture_key: 'r',
      source_model_call_id: 'c1',
      staging_keys: ack.staging_keys,
      prefix_token_count: ack.prefix_token_count,
      prefix_digest: ack.prefix_digest,
      effective_output_limit: ack.effective_output_limit,
    };
    const reply = await post('/ng-rollout/r-a1/v1/chat/completions', {
      messages: [USER],
      ng_capture: admission('c2', { rollout_id: 'r-a1', generation_cut: continuation }),
    });
    expect(reply.status).toBe(200);
    expect((await calls())[1]).toMatchObject({
      continued_from: 'c1',
      reused_prefix_tokens: 2,
      capture_error: null,
    });
    const whole = fake.state.tokens.stagedRecord('r/c1')!;
    const continued = fake.state.tokens.stagedRecord('r-a1/c2')!;
    // Same answer, two of its tokens reused from the cut rather than generated again.
    expect(continued.token_ids_delta).toEqual(whole.token_ids_delta);
  });

  test('a call this worker finished (its answer held by the gym) is cut as a terminal completion', async () => {
    await chat(admission('c1'));
    const ack = ((await cut('c1')).body.prefixes as Record<string, unknown>[])[0]!;
    expect(ack).toMatchObject({
      disposition: 'durable_prefix',
      cut_kind: 'terminal_completion',
      staging_keys: ['r/c1'],
      terminal_finish_reason: 'stop',
    });
    const reply = await post('/ng-rollout/r-a1/v1/chat/completions', {
      messages: [USER],
      ng_capture: admission('c2', {
        rollout_id: 'r-a1',
        generation_cut: {
          schema_version: 2,
          source_capture_key: 'r',
          source_model_call_id: 'c1',
          staging_keys: ack.staging_keys,
          prefix_token_count: ack.prefix_token_count,
          prefix_digest: ack.prefix_digest,
          effective_output_limit: ack.effective_output_limit,
          terminal_finish_reason: 'stop',
        },
      }),
    });
    expect(reply.status).toBe(200);
    // The whole answer is reused: nothing is generated again.
    expect((await calls())[1]).toMatchObject({
      continued_from: 'c1',
      reused_prefix_tokens: ack.prefix_token_count,
    });
  });

  test('the rebuild route verifies a manifest against the token store', async () => {
    const coords = (await chat(admission('c1'))).body.ng_commit_coords as Record<string, unknown>;
    const ok = await post('/_ctl/rebuild', { manifest: { rollout_id: 'r', records: [coords] } });
    expect(ok.body).toMatchObject({ call_ids: ['c1'], prompt_len: expect.any(Number) });
    const foreign = await post('/_ctl/rebuild', {
      manifest: { rollout_id: 'r', records: [{ ...coords, capture_key: 'other' }] },
    });
    expect(foreign.status).toBe(422);
    expect(foreign.body).toMatchObject({
      error: { detail: expect.stringContaining('foreign_capture_key') },
    });
  });
});
