/**
 * Scripted turns. The turn a call answers is read from the conversation it sends, never from a
 * per-process counter, so a restored rollout that re-sends its history gets the right next turn.
 */
import {
  type EpisodeId,
  InvalidRequestError,
  captureKey,
  parseCaptureKey,
} from '@ckpt-gym/core/protocol';

export interface ToolCallSpec {
  readonly name: string;
  /** A JSON object; sent as the JSON string OpenAI's `function.arguments` carries. */
  readonly arguments: Readonly<Record<string, unknown>>;
}

/**
 * A rollout's turns: the tool calls of each tool turn in order (the agent answers each call with a
 * `tool` message), then the final answer. The shape makes a script without a final answer impossible.
 */
export interface Script {
  readonly tool_turns: readonly (readonly ToolCallSpec[])[];
  readonly final_answer: string;
}

export type ScriptName = 'weather' | 'counter';

export const SCRIPTS: Readonly<Record<ScriptName, Script>> = {
  weather: {
    tool_turns: [[{ name: 'get_weather', arguments: { city: 'SF' } }]],
    final_answer: 'The weather in SF is sunny.',
  },
  counter: {
    tool_turns: [
      [{ name: 'increment_counter', arguments: { count: 1 } }],
      [{ name: 'increment_counter', arguments: { count: 2 } }],
    ],
    final_answer: 'I incremented the counter by 1 and then by 2.',
  },
};

export interface ChatMessage {
  readonly role: string;
  readonly [field: string]: unknown;
}

export interface ToolCall {
  readonly id: string;
  readonly type: 'function';
  readonly function: { readonly name: string; readonly arguments: string };
}

export type AssistantReply =
  | {
      readonly content: null;
      readonly tool_calls: readonly ToolCall[];
      readonly finish_reason: 'tool_calls';
    }
  | { readonly content: string; readonly finish_reason: 'stop' };

/** How many tool results the conversation already holds: each answers one scripted tool call. */
export function toolResultCount(messages: readonly ChatMessage[]): number {
  return messages.filter((m) => m.role === 'tool').length;
}

/**
 * The tool calls the next turn makes, for a conversation that already holds `toolResults` tool
 * results: the first tool turn not fully answered. Undefined once every tool turn is answered, which
 * means the final answer (also for a client that keeps calling after it).
 */
export function toolTurnAt(
  script: Script,
  toolResults: number,
): readonly ToolCallSpec[] | undefined {
  let answered = toolResults;
  for (const calls of script.tool_turns) {
    if (answered < calls.length) return calls;
    answered -= calls.length;
  }
  return undefined;
}

/** The reply call number `callIndex` gets for `messages`; tool call ids are unique per call. */
export function scriptedReply(
  script: Script,
  messages: readonly ChatMessage[],
  callIndex: number,
): AssistantReply {
  const calls = toolTurnAt(script, toolResultCount(messages));
  if (!calls) return { content: script.final_answer, finish_reason: 'stop' };
  return {
    content: null,
    tool_calls: calls.map((call, k) => ({
      id: `call_${callIndex}_${k}`,
      type: 'function',
      function: { name: call.name, arguments: JSON.stringify(call.arguments) },
    })),
    finish_reason: 'tool_calls',
  };
}

// --- parsing a script from a control body -----------------------------------------------------

function isPlainObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function parseToolCall(value: unknown, path: string): ToolCallSpec {
  if (!isPlainObject(value)) throw new InvalidRequestError(`${path}: must be an object`);
  const { name, arguments: args, ...extra } = value;
  const unknownKeys = Object.keys(extra);
  if (unknownKeys.length > 0) {
    throw new InvalidRequestError(`${path}: unknown keys ${unknownKeys.join(', ')}`);
  }
  if (typeof name !== 'string' || name === '') {
    throw new InvalidRequestError(`${path}.name: must be a non-empty string`);
  }
  if (!isPlainObject(args)) throw new InvalidRequestError(`${path}.arguments: must be an object`);
  return { name, arguments: args };
}

function parseToolTurn(value: unknown, path: string): readonly ToolCallSpec[] {
  if (!isPlainObject(value)) throw new InvalidRequestError(`${path}: must be an object`);
  const { tool_calls: calls, ...extra } = value;
  const unknownKeys = Object.keys(extra);
  if (unknownKeys.length > 0) {
    throw new InvalidRequestError(
      `${path}: unknown keys ${unknownKeys.join(', ')} (only the last turn is a final answer {content})`,
    );
  }
  if (!Array.isArray(calls) || calls.length === 0) {
    throw new InvalidRequestError(`${path}.tool_calls: must be a non-empty array`);
  }
  return calls.map((c, i) => parseToolCall(c, `${path}.tool_calls[${i}]`));
}

function parseFinalTurn(value: unknown, path: string): string {
  if (!isPlainObject(value)) throw new InvalidRequestError(`${path}: must be an object`);
  const { content, ...extra } = value;
  const unknownKeys = Object.keys(extra);
  if (unknownKeys.length > 0 || typeof content !== 'string') {
    throw new InvalidRequestError(
      `${path}: the last turn must be a final answer {content: string}`,
    );
  }
  return content;
}

/**
 * A script from a control body: a built-in name, or a turns list `[{tool_calls: [{name,
 * arguments}]}, …, {content}]` whose last turn is the final answer. Bad input is 422.
 */
export function parseScript(value: unknown, path = 'script'): Script {
  if (typeof value === 'string') {
    if (Object.hasOwn(SCRIPTS, value)) return SCRIPTS[value as ScriptName];
    throw new InvalidRequestError(
      `${path}: unknown script ${JSON.stringify(value)}; use ${Object.keys(SCRIPTS).join(' or ')} or a turns list`,
    );
  }
  if (!Array.isArray(value) || value.length === 0) {
    throw new InvalidRequestError(`${path}: must be a script name or a non-empty list of turns`);
  }
  const last = value.length - 1;
  return {
    tool_turns: value.slice(0, last).map((turn, i) => parseToolTurn(turn, `${path}[${i}]`)),
    final_answer: parseFinalTurn(value[last], `${path}[${last}]`),
  };
}

// --- which script a rollout follows -----------------------------------------------------------

/**
 * The default script and per-rollout overrides. An override is set for a capture key (`r-a1`: that
 * attempt only) or a rollout id (`r`: every attempt of `r`, since `r` is also attempt 0's key); the
 * exact capture key wins over the rollout id, which wins over the default.
 */
export class ScriptBook {
  private fallback: Script;
  private readonly overrides = new Map<string, Script>();

  constructor(defaultScript: Script = SCRIPTS.weather) {
    this.fallback = defaultScript;
  }

  setDefault(script: Script): void {
    this.fallback = script;
  }

  /** `key` is a capture key or rollout id; a malformed one is 422 `invalid_request`. */
  setFor(key: string, script: Script): void {
    try {
      parseCaptureKey(key);
    } catch (err) {
      throw new InvalidRequestError(`rollout: ${(err as Error).message}`);
    }
    this.overrides.set(key, script);
  }

  scriptFor(episode: EpisodeId | undefined): Script {
    if (!episode) return this.fallback;
    return (
      this.overrides.get(captureKey(episode)) ??
      this.overrides.get(episode.rollout_id) ??
      this.fallback
    );
  }
}
