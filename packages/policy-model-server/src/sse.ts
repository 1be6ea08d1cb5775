/** A minimal server-sent events reader: splits a text stream into events, tells comments apart. */

export interface SseEvent {
  /** The event as received, without its terminating blank line. */
  readonly raw: string;
  /** The joined `data:` lines; undefined for an event without data (a comment or keep-alive). */
  readonly data: string | undefined;
}

const EVENT_END = /\r?\n\r?\n/;

export function parseSseEvent(raw: string): SseEvent {
  const data: string[] = [];
  for (const line of raw.split(/\r?\n/)) {
    if (line.startsWith('data:')) data.push(line.slice(line.startsWith('data: ') ? 6 : 5));
  }
  return { raw, data: data.length > 0 ? data.join('\n') : undefined };
}

/** Feed text chunks; get back the complete events so far. `flush()` returns a trailing partial one. */
export class SseReader {
  #buffer = '';

  push(text: string): SseEvent[] {
    this.#buffer += text;
    const events: SseEvent[] = [];
    for (;;) {
      const match = EVENT_END.exec(this.#buffer);
      if (!match) break;
      const raw = this.#buffer.slice(0, match.index);
      this.#buffer = this.#buffer.slice(match.index + match[0].length);
      if (raw.trim() !== '') events.push(parseSseEvent(raw));
    }
    return events;
  }

  flush(): SseEvent[] {
    const rest = this.#buffer;
    this.#buffer = '';
    return rest.trim() === '' ? [] : [parseSseEvent(rest)];
  }
}
