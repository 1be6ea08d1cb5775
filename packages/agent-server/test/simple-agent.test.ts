import express from 'express';

import { createHttpClients } from '@ckpt-gym/core/client';
import { type AgentSeedRequest, type JsonObject } from '@ckpt-gym/core/protocol';
import { createLogger, listen } from '@ckpt-gym/core/server';
import { responseWith, startStubModel, startStubToolResources } from '@ckpt-gym/testing';

import type { ActivationHandle } from '../src/participant.js';

import { createAgentServer } from '../src/app.js';
import { type AgentSessionEntry, mergeSetCookies } from '../src/sessions.js';
import {
  exportSession,
  type LoopState,
  rebuildQuestions,
  runTurnLoop,
  simpleAgent,
  type SimpleSessionState,
  toolBaseUrl,
} from '../src/simple-agent.js';
import { simpleAgentConfig } from '../src/config.js';
import { activate, errorCode, post, seed, startStack } from './support/harness.js';

/** One `/v1/responses` call to a Simple Agent (no checkpointing) whose model server is `modelUrl`. */
async function askAgent(modelUrl: string): Promise<{ status: number; body: JsonObject }> {
  const agent = createAgentServer(simpleAgent, {
    name: 'a',
    checkpoint: undefined,
    config: { model_server_url: modelUrl },
    logger: createLogger({ level: 'error' }),
  });
  const server = await listen(agent.app, 0);
  try {
    const res = await fetch(`${server.url}/v1/responses`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ input: 'hi' }),
    });
    return { status: res.status, body: (await res.json()) as JsonObject };
  } finally {
    await server.close();
    agent.close();
  }
}

describe('Simple Agent turn loop', () => {
  test('max_steps stops the loop after that many model calls, as incomplete', async () => {
    await using h = await startStack({ config: { max_steps: 1 } });
    const s = await seed(h, 'sess-1', 'r1');
    const reply = await activate(h, s, 'r1', 1);
    expect(reply.body.status).toBe('incomplete');
    expect(h.model.calls).toHaveLength(1);
    expect(h.resources.calls).toHaveLength(1);
  });

  test('each turn resends the whole conversation', async () => {
    await using h = await startStack();
    const s = await seed(h, 'sess-1', 'r1');
    await activate(h, s, 'r1', 1);
    const second = h.model.calls[1]!.body.input as { type: string }[];
    expect(second.map((i) => i.type)).toEqual(['message', 'function_call', 'function_call_output']);
  });

  test('invalid tool call arguments become an error output without a tool call', async () => {
    const model = express();
    model.use(express.json());
    let calls = 0;
    model.post(/.*/, (_req, res) => {
      calls += 1;
      res.json(
        responseWith(
          calls === 1
            ? [
                {
                  type: 'function_call',
                  call_id: 'c1',
                  name: 'get_weather',
                  arguments: '{not json',
                },
              ]
            : [
                {
                  type: 'message',
                  role: 'assistant',
                  content: [{ type: 'output_text', text: 'ok' }],
                },
              ],
        ),
      );
    });
    const modelServer = await listen(model, 0);
    try {
      const reply = await askAgent(modelServer.url);
      const output = reply.body.output as { type: string; output?: string }[];
      expect(output[1]!.output).toMatch(/Invalid tool call arguments/);
    } finally {
      await modelServer.close();
    }
  });
});

describe('Simple Agent upstream failures', () => {
  test('an input item that is no object is 422 invalid_request before the model is called', async () => {
    await using h = await startStack({ checkpoint: false });
    for (const input of [[null], ['hi'], [[]], 5]) {
      const reply = await post(`${h.url}/v1/responses`, { input });
      expect([input, reply.status, errorCode(reply)]).toEqual([input, 422, 'invalid_request']);
    }
    expect(h.model.calls).toEqual([]);
  });

  test("the model server's refusal in the standard shape is passed on as it is", async () => {
    const model = express();
    model.post(/.*/, (_req, res) => {
      res.status(422).json({ error: { code: 'invalid_request', detail: 'input[0]: nope' } });
    });
    const modelServer = await listen(model, 0);
    try {
      expect(await askAgent(modelServer.url)).toEqual({
        status: 422,
        body: { error: { code: 'invalid_request', detail: 'input[0]: nope' } },
      });
    } finally {
      await modelServer.close();
    }
  });

  test('a model server that cannot be reached is a 502 upstream_error naming it', async () => {
    const gone = await listen(express(), 0);
    await gone.close();
    const reply = await askAgent(gone.url);
    expect(reply.status).toBe(502);
    expect(reply.body.error).toMatchObject({ code: 'upstream_error' });
    expect((reply.body.error as { detail: string }).detail).toContain(`${gone.url}/v1/responses`);
    expect((reply.body.error as { detail: string }).detail).toMatch(/ECONNREFUSED/);
  });

  test('a model reply that is no Responses API response, or a foreign error page, is a 502 upstream_error', async () => {
    const model = express();
    let call = 0;
    model.post(/.*/, (_req, res) => {
      call += 1;
      if (call === 1) res.json({ hello: 'world' });
      else res.status(503).type('text/html').send('<html>busy</html>');
    });
    const modelServer = await listen(model, 0);
    try {
      const notResponses = await askAgent(modelServer.url);
      expect([notResponses.status, notResponses.body.error]).toEqual([
        502,
        expect.objectContaining({ code: 'upstream_error' }),
      ]);
      expect((notResponses.body.error as { detail: string }).detail).toMatch(
        /not a Responses API response/,
      );
      const page = await askAgent(modelServer.url);
      expect([page.status, page.body.error]).toEqual([
        502,
        expect.objectContaining({ code: 'upstream_error' }),
      ]);
    } finally {
      await modelServer.close();
    }
  });
});

describe('Simple Agent helpers', () => {
  test('tool calls go under the activation prefix in place of the grant’s', () => {
    expect(toolBaseUrl('http://h:1/ng-rollout/r1', { rollout_id: 'r1', attempt: 2 })).toBe(
      'http://h:1/ng-rollout/r1-a2',
    );
    expect(toolBaseUrl('http://h:1/', undefined)).toBe('http://h:1');
  });

  test('questions are rebuilt from the input and the outputs each one held', () => {
    const input = [{ type: 'message' }];
    const outputs = [
      { type: 'function_call' },
      { type: 'function_call_output' },
      { type: 'message' },
    ];
    expect(rebuildQuestions(input, outputs, [0, 2]).map((q) => q.length)).toEqual([1, 3]);
  });

  test('a jar with no cookies set stays as it was, including none', () => {
    expect(mergeSetCookies(null, undefined)).toBeNull();
    expect(mergeSetCookies(null, ['a=1; Path=/'])).toEqual({ a: '1' });
  });
});

describe('Simple Agent boundaries', () => {
  /** A handle that records each boundary as built at the time (and never parks). */
  function recordingHandle(continuation: JsonObject | null = null) {
    const boundaries: JsonObject[] = [];
    const handle: ActivationHandle = {
      key: 'k',
      signal: new AbortController().signal,
      continuation,
      boundary: async (build) => {
        boundaries.push(build());
      },
      awaitingModel: (call) => call(),
    };
    return { handle, boundaries };
  }

  async function loop(continuation: JsonObject | null = null) {
    const model = await startStubModel();
    const resources = await startStubToolResources();
    const clients = createHttpClients();
    const { handle, boundaries } = recordingHandle(continuation);
    try {
      const result = await runTurnLoop({
        http: clients.data,
        config: simpleAgentConfig({ model_server_url: model.url }),
        body: { input: 'weather?' },
        episode: { rollout_id: 'r1', attempt: 0 },
        handle,
        invocationId: 'root',
        tools: { baseUrl: `${resources.url}/ng-rollout/r1`, headers: {} },
        jar: null,
        modelCookies: {},
      });
      return {
        result,
        boundaries,
        modelCalls: model.calls.length,
        toolCalls: resources.calls.length,
      };
    } finally {
      clients.close();
      await model.close();
      await resources.close();
    }
  }

  test('boundaries come before each model call and after the reply that asks for tools', async () => {
    const { boundaries } = await loop();
    expect(
      boundaries.map((b) => [b.step, b.pending_tools, (b.new_outputs as unknown[]).length]),
    ).toEqual([
      [0, false, 0],
      [1, true, 1],
      [1, false, 2],
    ]);
  });

  test('a loop continued from a pending-tools boundary runs the tools without calling the model first', async () => {
    const { boundaries } = await loop();
    const pending = boundaries[1] as unknown as LoopState;
    const continued = await loop(pending as unknown as JsonObject);
    expect(continued.toolCalls).toBe(1);
    expect(continued.modelCalls).toBe(1);
    expect(continued.result.state.question_outputs).toEqual([0, 2]);
  });
});

describe('session export', () => {
  function entry(): AgentSessionEntry<SimpleSessionState> {
    return {
      id: 'sess-1',
      request: {
        agent_session_id: 'sess-1',
        episode_id: { rollout_id: 'r1', attempt: 0 },
        task_id: null,
        tool_accesses: [],
        sandbox_access: null,
      } as unknown as AgentSeedRequest,
      fingerprint: 'f',
      episode: { rollout_id: 'r1', attempt: 0 },
      activations: 1,
      completedActivation: 0,
      completedReply: null,
      closing: false,
      state: { toolAccess: null, resourcesCookies: { a: '1' }, observations: [] },
    };
  }

  test('an unchanged session is exported as the same object, a changed one as a new one', () => {
    const e = entry();
    const first = exportSession(e);
    expect(exportSession(e)).toBe(first);
    e.state.observations.push({ invocation: 'root' });
    const grown = exportSession(e);
    expect(grown).not.toBe(first);
    expect(grown.observations).toHaveLength(1);
    e.completedActivation = 1;
    const completed = exportSession(e);
    expect(completed).not.toBe(grown);
    expect(completed.completed_activation).toBe(1);
    e.state.resourcesCookies = { a: '2' };
    expect(exportSession(e)).not.toBe(completed);
    expect(exportSession(e).resources_cookies).toEqual({ a: '2' });
  });
});
