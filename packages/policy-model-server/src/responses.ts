/**
 * Responses API ⇄ chat completions, as pure functions. The backend speaks chat completions only;
 * the proxy converts a `/v1/responses` request into a chat request, and the chat answer (one JSON
 * object, or a stream of chunks) back into a Response (or its stream of events).
 */
import { InvalidRequestError } from '@ckpt-gym/core/protocol';

type Obj = Record<string, unknown>;

export interface ChatMessage {
  role: string;
  content: string | unknown[] | null;
  tool_calls?: ChatToolCall[];
  tool_call_id?: string;
  reasoning_content?: string;
}

export interface ChatToolCall {
  id: string;
  type: 'function';
  function: { name: string; arguments: string };
}

function isObj(value: unknown): value is Obj {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function str(value: unknown, path: string): string {
  if (typeof value !== 'string') throw new InvalidRequestError(`${path}: must be a string`);
  return value;
}

/** Text of a Responses content value: a string, or the text parts of a list. */
function contentText(content: unknown): string {
  if (typeof content === 'string') return content;
  if (!Array.isArray(content)) return '';
  return content
    .map((part) => (isObj(part) && typeof part.text === 'string' ? part.text : ''))
    .join('');
}

/** Responses content parts → chat content parts (text and images; other kinds are refused). */
function chatContent(content: unknown, path: string): string | unknown[] {
  if (typeof content === 'string') return content;
  if (!Array.isArray(content)) throw new InvalidRequestError(`${path}: must be a string or a list`);
  const parts = content.map((part, i) => {
    if (!isObj(part)) throw new InvalidRequestError(`${path}[${i}]: must be an object`);
    switch (part.type) {
      case 'input_text':
      case 'output_text':
      case 'text':
        return { type: 'text', text: str(part.text, `${path}[${i}].text`) };
      case 'input_image':
        return {
          type: 'image_url',
          image_url: { url: str(part.image_url, `${path}[${i}].image_url`) },
        };
      default:
        throw new InvalidRequestError(
          `${path}[${i}].type: unsupported content part ${JSON.stringify(part.type)}`,
        );
    }
  });
  // A list of text parts only is sent as one string: every chat backend accepts that.
  return parts.every((p) => p.type === 'text')
    ? parts.map((p) => (p as { text: string }).text).join('')
    : parts;
}

function reasoningText(item: Obj): string {
  const fromContent = contentText(item.content);
  return fromContent !== '' ? fromContent : contentText(item.summary);
}

/** Responses `input` (+ `instructions`) → chat messages. */
export function inputToMessages(input: unknown, instructions?: unknown): ChatMessage[] {
  const messages: ChatMessage[] = [];
  if (typeof instructions === 'string' && instructions !== '') {
    messages.push({ role: 'system', content: instructions });
  }
  if (typeof input === 'string') {
    messages.push({ role: 'user', content: input });
    return messages;
  }
  if (!Array.isArray(input)) throw new InvalidRequestError('input: must be a string or a list');
  let pendingReasoning: string | undefined;
  /** The assistant message function calls and reasoning attach to, while consecutive. */
  let assistant: ChatMessage | undefined;
  const openAssistant = (): ChatMessage => {
    if (!assistant) {
      assistant = { role: 'assistant', content: null };
      messages.push(assistant);
    }
    if (pendingReasoning !== undefined) {
      assistant.reasoning_content = pendingReasoning;
      pendingReasoning = undefined;
    }
    return assistant;
  };
  input.forEach((item, i) => {
    const path = `input[${i}]`;
    if (!isObj(item)) throw new InvalidRequestError(`${path}: must be an object`);
    const type = item.type ?? 'message';
    switch (type) {
      case 'message': {
        const role = str(item.role, `${path}.role`);
        if (role === 'assistant') {
          assistant = undefined;
          const message = openAssistant();
          message.content = contentText(item.content);
        } else {
          assistant = undefined;
          messages.push({
            role: role === 'developer' ? 'system' : role,
            content: chatContent(item.content, `${path}.content`),
          });
        }
        return;
      }
      case 'function_call': {
        const message = openAssistant();
        message.tool_calls ??= [];
        message.tool_calls.push({
          id: str(item.call_id, `${path}.call_id`),
          type: 'function',
          function: {
            name: str(item.name, `${path}.name`),
            arguments: str(item.arguments, `${path}.arguments`),
          },
        });
        return;
      }
      case 'function_call_output':
        assistant = undefined;
        messages.push({
          role: 'tool',
          tool_call_id: str(item.call_id, `${path}.call_id`),
          content: typeof item.output === 'string' ? item.output : contentText(item.output),
        });
        return;
      case 'reasoning':
        // Reasoning belongs to the assistant turn that follows it.
        assistant = undefined;
        pendingReasoning = reasoningText(item);
        return;
      default:
        throw new InvalidRequestError(`${path}.type: unsupported item ${JSON.stringify(type)}`);
    }
  });
  return messages;
}

function chatTools(tools: unknown): Obj[] | undefined {
  if (tools === undefined) return undefined;
  if (!Array.isArray(tools)) throw new InvalidRequestError('tools: must be a list');
  return tools.map((tool, i) => {
    if (!isObj(tool) || tool.type !== 'function') {
      throw new InvalidRequestError(`tools[${i}]: only function tools are supported`);
    }
    const fn: Obj = { name: str(tool.name, `tools[${i}].name`) };
    if (tool.description !== undefined) fn.description = tool.description;
    if (tool.parameters !== undefined) fn.parameters = tool.parameters;
    if (tool.strict !== undefined && tool.strict !== null) fn.strict = tool.strict;
    return { type: 'function', function: fn };
  });
}

function chatToolChoice(choice: unknown): unknown {
  if (isObj(choice) && choice.type === 'function') {
    return { type: 'function', function: { name: str(choice.name, 'tool_choice.name') } };
  }
  return choice;
}

/** A `/v1/responses` body → the chat completions body sent to the backend. */
export function responsesToChatRequest(body: Obj): Obj {
  const chat: Obj = { messages: inputToMessages(body.input, body.instructions) };
  const copy = (from: string, to = from) => {
    if (body[from] !== undefined && body[from] !== null) chat[to] = body[from];
  };
  copy('model');
  copy('temperature');
  copy('top_p');
  copy('max_output_tokens', 'max_tokens');
  copy('parallel_tool_calls');
  copy('user');
  copy('metadata');
  const tools = chatTools(body.tools);
  if (tools && tools.length > 0) chat.tools = tools;
  if (body.tool_choice !== undefined) chat.tool_choice = chatToolChoice(body.tool_choice);
  if (isObj(body.reasoning) && typeof body.reasoning.effort === 'string') {
    chat.reasoning_effort = body.reasoning.effort;
  }
  if (body.stream === true) {
    chat.stream = true;
    chat.stream_options = { include_usage: true };
  }
  return chat;
}

// --- answers ------------------------------------------------------------------------------------

export interface ResponseUsage {
  input_tokens: number;
  output_tokens: number;
  total_tokens: number;
  input_tokens_details: { cached_tokens: number };
  output_tokens_details: { reasoning_tokens: number };
}

function usageOf(chatUsage: unknown): ResponseUsage | null {
  if (!isObj(chatUsage)) return null;
  const input = Number(chatUsage.prompt_tokens ?? 0);
  const output = Number(chatUsage.completion_tokens ?? 0);
  return {
    input_tokens: input,
    output_tokens: output,
    total_tokens: Number(chatUsage.total_tokens ?? input + output),
    input_tokens_details: { cached_tokens: 0 },
    output_tokens_details: { reasoning_tokens: 0 },
  };
}

/** The reasoning text of a chat message or delta (`reasoning_content`, or vLLM's `reasoning`). */
function reasoningOf(message: Obj): string | undefined {
  const text = message.reasoning_content ?? message.reasoning;
  return typeof text === 'string' && text !== '' ? text : undefined;
}

/** The Response envelope fields echoed from the request. */
function envelope(request: Obj, id: string, createdAt: number, model: unknown): Obj {
  return {
    id,
    object: 'response',
    created_at: createdAt,
    status: 'in_progress',
    model: model ?? request.model ?? null,
    output: [],
    error: null,
    incomplete_details: null,
    instructions: request.instructions ?? null,
    metadata: request.metadata ?? {},
    parallel_tool_calls: request.parallel_tool_calls ?? true,
    temperature: request.temperature ?? null,
    top_p: request.top_p ?? null,
    tool_choice: request.tool_choice ?? 'auto',
    tools: request.tools ?? [],
    reasoning: request.reasoning ?? null,
    text: { format: { type: 'text' } },
    usage: null,
  };
}

function finishStatus(finishReason: unknown): Pick<Obj, 'status' | 'incomplete_details'> {
  return finishReason === 'length'
    ? { status: 'incomplete', incomplete_details: { reason: 'max_output_tokens' } }
    : { status: 'completed', incomplete_details: null };
}

const reasoningItem = (id: string, text: string): Obj => ({
  type: 'reasoning',
  id,
  summary: [],
  content: [{ type: 'reasoning_text', text }],
});

const messageItem = (id: string, text: string, status = 'completed'): Obj => ({
  type: 'message',
  id,
  role: 'assistant',
  status,
  content: [{ type: 'output_text', text, annotations: [] }],
});

const functionCallItem = (
  id: string,
  callId: string,
  name: string,
  args: string,
  status = 'completed',
): Obj => ({ type: 'function_call', id, call_id: callId, name, arguments: args, status });

/** The Response id for a chat completion id. */
export function responseIdFor(chatId: unknown): string {
  return `resp_${typeof chatId === 'string' && chatId !== '' ? chatId : 'unknown'}`;
}

/** A chat completion → a Response. */
export function chatToResponse(request: Obj, completion: Obj): Obj {
  const choices = Array.isArray(completion.choices) ? completion.choices : [];
  const choice = isObj(choices[0]) ? choices[0] : {};
  const message = isObj(choice.message) ? choice.message : {};
  const base = String(completion.id ?? 'unknown');
  const output: Obj[] = [];
  const reasoning = reasoningOf(message);
  if (reasoning !== undefined) output.push(reasoningItem(`rs_${base}`, reasoning));
  if (typeof message.content === 'string' && message.content !== '') {
    output.push(messageItem(`msg_${base}`, message.content));
  }
  const toolCalls = Array.isArray(message.tool_calls) ? message.tool_calls : [];
  toolCalls.forEach((call: unknown, i) => {
    if (!isObj(call) || !isObj(call.function)) return;
    output.push(
      functionCallItem(
        `fc_${base}_${i}`,
        String(call.id ?? `call_${i}`),
        String(call.function.name ?? ''),
        String(call.function.arguments ?? ''),
      ),
    );
  });
  return {
    ...envelope(
      request,
      responseIdFor(completion.id),
      Number(completion.created ?? 0),
      completion.model,
    ),
    ...finishStatus(choice.finish_reason),
    output,
    usage: usageOf(completion.usage),
  };
}

// --- streaming ----------------------------------------------------------------------------------

interface OpenText {
  kind: 'reasoning' | 'message';
  index: number;
  id: string;
  text: string;
}

interface OpenCall {
  index: number;
  id: string;
  callId: string;
  name: string;
  args: string;
}

/**
 * Chat completion chunks → Responses stream events, one chunk at a time. Feed every parsed
 * chunk to `chunk()` and call `finish()` at `[DONE]` (or at the end of the stream); each returns
 * the events to send, in order, already numbered.
 */
export class ResponsesStream {
  #seq = 0;
  #started = false;
  #output: Obj[] = [];
  #text: OpenText | undefined;
  #calls = new Map<number, OpenCall>();
  #base = 'unknown';
  #createdAt = 0;
  #model: unknown;
  #finishReason: unknown;
  #usage: ResponseUsage | null = null;

  constructor(private readonly request: Obj) {}

  #event(type: string, fields: Obj): Obj {
    return { type, sequence_number: this.#seq++, ...fields };
  }

  #envelope(): Obj {
    return envelope(this.request, responseIdFor(this.#base), this.#createdAt, this.#model);
  }

  chunk(chunk: Obj): Obj[] {
    const events: Obj[] = [];
    if (!this.#started) {
      this.#started = true;
      this.#base = String(chunk.id ?? 'unknown');
      this.#createdAt = Number(chunk.created ?? 0);
      this.#model = chunk.model;
      events.push(this.#event('response.created', { response: this.#envelope() }));
      events.push(this.#event('response.in_progress', { response: this.#envelope() }));
    }
    if (chunk.usage) this.#usage = usageOf(chunk.usage);
    const choices = Array.isArray(chunk.choices) ? chunk.choices : [];
    const choice = isObj(choices[0]) ? choices[0] : undefined;
    if (!choice) return events;
    const delta = isObj(choice.delta) ? choice.delta : {};
    const reasoning = reasoningOf(delta);
    if (reasoning !== undefined) events.push(...this.#textDelta('reasoning', reasoning));
    if (typeof delta.content === 'string' && delta.content !== '') {
      events.push(...this.#textDelta('message', delta.content));
    }
    if (Array.isArray(delta.tool_calls)) {
      for (const call of delta.tool_calls) if (isObj(call)) events.push(...this.#callDelta(call));
    }
    if (choice.finish_reason !== undefined && choice.finish_reason !== null) {
      this.#finishReason = choice.finish_reason;
    }
    return events;
  }

  #textDelta(kind: OpenText['kind'], delta: string): Obj[] {
    const events: Obj[] = [];
    if (this.#text?.kind !== kind) {
      events.push(...this.#closeText());
      const index = this.#output.length;
      const id = `${kind === 'reasoning' ? 'rs' : 'msg'}_${this.#base}_${index}`;
      this.#text = { kind, index, id, text: '' };
      const item =
        kind === 'reasoning' ? reasoningItem(id, '') : messageItem(id, '', 'in_progress');
      item.content = [];
      this.#output.push(item);
      events.push(this.#event('response.output_item.added', { output_index: index, item }));
      const part =
        kind === 'reasoning'
          ? { type: 'reasoning_text', text: '' }
          : { type: 'output_text', text: '', annotations: [] };
      events.push(
        this.#event('response.content_part.added', {
          item_id: id,
          output_index: index,
          content_index: 0,
          part,
        }),
      );
    }
    const open = this.#text!;
    open.text += delta;
    events.push(
      this.#event(
        kind === 'reasoning' ? 'response.reasoning_text.delta' : 'response.output_text.delta',
        {
          item_id: open.id,
          output_index: open.index,
          content_index: 0,
          delta,
          ...(kind === 'message' ? { logprobs: [] } : {}),
        },
      ),
    );
    return events;
  }

  #closeText(): Obj[] {
    const open = this.#text;
    if (!open) return [];
    this.#text = undefined;
    const item =
      open.kind === 'reasoning'
        ? reasoningItem(open.id, open.text)
        : messageItem(open.id, open.text);
    this.#output[open.index] = item;
    const part = (item.content as Obj[])[0];
    const where = { item_id: open.id, output_index: open.index, content_index: 0 };
    return [
      this.#event(
        open.kind === 'reasoning' ? 'response.reasoning_text.done' : 'response.output_text.done',
        { ...where, text: open.text, ...(open.kind === 'message' ? { logprobs: [] } : {}) },
      ),
      this.#event('response.content_part.done', { ...where, part }),
      this.#event('response.output_item.done', { output_index: open.index, item }),
    ];
  }

  #callDelta(call: Obj): Obj[] {
    const events: Obj[] = [];
    const key = typeof call.index === 'number' ? call.index : 0;
    const fn = isObj(call.function) ? call.function : {};
    let open = this.#calls.get(key);
    if (!open) {
      events.push(...this.#closeText());
      const index = this.#output.length;
      open = {
        index,
        id: `fc_${this.#base}_${index}`,
        callId: String(call.id ?? `call_${key}`),
        name: String(fn.name ?? ''),
        args: '',
      };
      this.#calls.set(key, open);
      const item = functionCallItem(open.id, open.callId, open.name, '', 'in_progress');
      this.#output.push(item);
      events.push(this.#event('response.output_item.added', { output_index: index, item }));
    }
    if (typeof fn.arguments === 'string' && fn.arguments !== '') {
      open.args += fn.arguments;
      events.push(
        this.#event('response.function_call_arguments.delta', {
          item_id: open.id,
          output_index: open.index,
          delta: fn.arguments,
        }),
      );
    }
    return events;
  }

  /** Closes every open item and completes the response. */
  finish(): Obj[] {
    const events: Obj[] = [];
    if (!this.#started) events.push(...this.chunk({}));
    events.push(...this.#closeText());
    for (const open of [...this.#calls.values()].sort((a, b) => a.index - b.index)) {
      const item = functionCallItem(open.id, open.callId, open.name, open.args);
      this.#output[open.index] = item;
      events.push(
        this.#event('response.function_call_arguments.done', {
          item_id: open.id,
          output_index: open.index,
          name: open.name,
          arguments: open.args,
        }),
        this.#event('response.output_item.done', { output_index: open.index, item }),
      );
    }
    this.#calls.clear();
    const response = {
      ...this.#envelope(),
      ...finishStatus(this.#finishReason),
      output: this.#output,
      usage: this.#usage,
    };
    const type = response.status === 'completed' ? 'response.completed' : 'response.incomplete';
    events.push(this.#event(type, { response }));
    return events;
  }

  /** The Response id, known from the first chunk on. */
  get responseId(): string {
    return responseIdFor(this.#base);
  }
}
