/**
 * Reading the agent's final Responses API output in `/verify`: the names of the tools it called
 * and the text it wrote. A plain string stands for a text-only response.
 */
import type { JsonObject, JsonValue } from '@ckpt-gym/core/protocol';

function outputItems(response: JsonValue | undefined): JsonObject[] {
  if (typeof response !== 'object' || response === null || Array.isArray(response)) return [];
  const output = response.output;
  if (!Array.isArray(output)) return [];
  return output.filter(
    (item): item is JsonObject => typeof item === 'object' && item !== null && !Array.isArray(item),
  );
}

/** Names of the `function_call` items, in order. */
export function calledTools(response: JsonValue | undefined): string[] {
  return outputItems(response)
    .filter((item) => item.type === 'function_call' && typeof item.name === 'string')
    .map((item) => item.name as string);
}

/** The assistant's text: the `output_text` parts of its messages, joined; or the string itself. */
export function responseText(response: JsonValue | undefined): string {
  if (typeof response === 'string') return response;
  if (typeof response === 'object' && response !== null && !Array.isArray(response)) {
    if (typeof response.output_text === 'string') return response.output_text;
  }
  const parts: string[] = [];
  for (const item of outputItems(response)) {
    if (item.type !== 'message' || !Array.isArray(item.content)) continue;
    for (const part of item.content) {
      if (typeof part === 'object' && part !== null && !Array.isArray(part)) {
        if (part.type === 'output_text' && typeof part.text === 'string') parts.push(part.text);
      }
    }
  }
  return parts.join('\n');
}
