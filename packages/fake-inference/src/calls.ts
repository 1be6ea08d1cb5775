/**
 * The call log and the token store. Both live in the fake's own process, so tests can still read
 * them after every gym process was killed.
 */
import { type StagedCallRecord } from '@ckpt-gym/core/capture';
import { type EpisodeId, captureKey } from '@ckpt-gym/core/protocol';

import type { AssistantReply, ChatMessage } from './script.js';

// --- deterministic tokens ---------------------------------------------------------------------

const VOCAB_SIZE = 32_000;
const TOKEN_CHUNK = /[\p{L}\p{N}_]+|[^\s\p{L}\p{N}_]/gu;

/** FNV-1a over UTF-16 code units: stable across runs and processes, unlike any seeded hash. */
function fnv1a(text: string): number {
  let hash = 0x811c9dc5;
  for (let i = 0; i < text.length; i++) {
    hash ^= text.charCodeAt(i);
    hash = Math.imul(hash, 0x01000193);
  }
  return hash >>> 0;
}

/** One made-up token id in [1, VOCAB_SIZE) per word or punctuation mark; the same text, the same ids. */
export function tokenize(text: string): number[] {
  return Array.from(text.matchAll(TOKEN_CHUNK), ([chunk]) => 1 + (fnv1a(chunk) % (VOCAB_SIZE - 1)));
}

function partText(part: unknown): string {
  if (typeof part === 'string') return part;
  const text = (part as { text?: unknown } | null)?.text;
  return typeof text === 'string' ? text : '';
}

/** The text a message contributes to the prompt: role, content (string or text parts), tool calls. */
export function messageText(message: ChatMessage): string {
  const content = Array.isArray(message.content)
    ? message.content.map(partText).join(' ')
    : partText(message.content);
  const calls = Array.isArray(message.tool_calls) ? message.tool_calls : [];
  const callText = calls.map((call) => {
    const fn = (call as { function?: { name?: unknown; arguments?: unknown } } | null)?.function;
    return `${String(fn?.name ?? '')} ${String(fn?.arguments ?? '')}`;
  });
  return [message.role, content, ...callText].join(' ');
}

export function promptTokens(messages: readonly ChatMessage[]): number[] {
  return messages.flatMap((m) => tokenize(messageText(m)));
}

export function completionTokens(reply: AssistantReply): number[] {
  if (reply.finish_reason === 'stop') return tokenize(reply.content);
  return reply.tool_calls.flatMap((c) => tokenize(`${c.function.name} ${c.function.arguments}`));
}

export interface CallTokens {
  readonly prompt_token_ids: readonly number[];
  readonly completion_token_ids: readonly number[];
}

/**
 * Token ids per call, the durable token store (staged records by staging key: completed calls
 * and generation-cut prefixes) and the generation-cut rounds (each the model call ids that got a
 * durable prefix). It lives in this process, so it survives a crash of every gym process.
 */
export class TokenStore {
  private readonly byCall = new Map<number, CallTokens>();
  private readonly rounds: string[][] = [];
  private readonly staged = new Map<string, StagedCallRecord>();
  /** Staging key of each completed call, by model call id (a cut of a finished call reuses it). */
  private readonly completed = new Map<string, string>();

  stage(stagingKey: string, record: StagedCallRecord): void {
    this.staged.set(stagingKey, record);
  }

  /** Stages a completed call's record and remembers it under its model call id. */
  stageCompleted(stagingKey: string, record: StagedCallRecord): void {
    this.stage(stagingKey, record);
    this.completed.set(record.model_call_id, stagingKey);
  }

  /** The staging key of a completed call, if this worker completed it. */
  completedKey(modelCallId: string): string | undefined {
    return this.completed.get(modelCallId);
  }

  stagedRecord(stagingKey: string): StagedCallRecord | undefined {
    return this.staged.get(stagingKey);
  }

  get stagedCount(): number {
    return this.staged.size;
  }

  put(callIndex: number, tokens: CallTokens): void {
    this.byCall.set(callIndex, tokens);
  }

  get(callIndex: number): CallTokens | undefined {
    return this.byCall.get(callIndex);
  }

  recordCutRound(modelCallIds: readonly string[]): void {
    this.rounds.push([...modelCallIds]);
  }

  cutRounds(): string[][] {
    return this.rounds.map((round) => [...round]);
  }
}

// --- the call log -----------------------------------------------------------------------------

export interface CallRecord {
  /** 0-based, in arrival order over the whole process. */
  readonly index: number;
  readonly capture_key: string | null;
  readonly rollout_id: string | null;
  readonly attempt: number | null;
  readonly n_messages: number;
  /** The request's `ng_capture` field, or null. */
  readonly admission: unknown;
  readonly stream: boolean;
  /** The call waited for a hold or the gate before answering. */
  held: boolean;
  /** The whole answer was written. */
  returned: boolean;
  /** The client went away before the answer was written. */
  dropped: boolean;
  /** The model call id whose generation-cut prefix this call continued. */
  continued_from: string | null;
  /** Generated tokens of that prefix this call did not generate again. */
  reused_prefix_tokens: number;
  /** Why the call's tokens were not staged (an invalid admission or cut), or null. */
  capture_error: string | null;
  /** The `x-request-id` the call arrived with (e2e follows one request id across servers). */
  readonly request_id: string | null;
}

export interface CallView extends CallRecord {
  readonly prompt_tokens: number;
  readonly completion_tokens: number;
}

export interface NewCall {
  readonly episode: EpisodeId | undefined;
  readonly n_messages: number;
  readonly admission: unknown;
  readonly stream: boolean;
  readonly request_id?: string | undefined;
}

export interface AdmittedCall {
  readonly record: CallRecord;
  /** 0-based position among its rollout's calls (all attempts); null for an untagged call. */
  readonly rolloutCallIndex: number | null;
}

export class CallLog {
  private readonly records: CallRecord[] = [];
  private readonly perRollout = new Map<string, number>();

  constructor(readonly tokens: TokenStore) {}

  /** Records a call on arrival, before any wait, so held calls are visible. */
  admit(call: NewCall): AdmittedCall {
    const { episode } = call;
    let rolloutCallIndex: number | null = null;
    if (episode) {
      rolloutCallIndex = this.perRollout.get(episode.rollout_id) ?? 0;
      this.perRollout.set(episode.rollout_id, rolloutCallIndex + 1);
    }
    const record: CallRecord = {
      index: this.records.length,
      capture_key: episode ? captureKey(episode) : null,
      rollout_id: episode?.rollout_id ?? null,
      attempt: episode?.attempt ?? null,
      n_messages: call.n_messages,
      admission: call.admission,
      stream: call.stream,
      held: false,
      returned: false,
      dropped: false,
      continued_from: null,
      reused_prefix_tokens: 0,
      capture_error: null,
      request_id: call.request_id ?? null,
    };
    this.records.push(record);
    return { record, rolloutCallIndex };
  }

  get count(): number {
    return this.records.length;
  }

  list(): CallView[] {
    return this.records.map((record) => {
      const tokens = this.tokens.get(record.index);
      return {
        ...record,
        prompt_tokens: tokens?.prompt_token_ids.length ?? 0,
        completion_tokens: tokens?.completion_token_ids.length ?? 0,
      };
    });
  }
}
