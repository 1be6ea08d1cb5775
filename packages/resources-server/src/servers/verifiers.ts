/**
 * Training verifiers: each verifies one request on its own, from the body, and keeps no session
 * state, so they declare `stateless` with `replay` verification — a checkpoint never waits for
 * them, and a verification cut by a crash simply runs again. The expected answer is the task
 * data's `expected_answer`.
 */
import type { JsonValue } from '@ckpt-gym/core/protocol';

import type { ResourcesServerDefinition, VerifyContext } from '../definition.js';
import { responseText } from '../responses.js';

function expectedAnswer(ctx: VerifyContext): JsonValue | undefined {
  return ctx.taskData.expected_answer ?? ctx.seededTaskData?.expected_answer;
}

function normalise(text: string): string {
  return text.trim().replace(/\s+/g, ' ').toLowerCase();
}

/** Reward 1.0 when the response text equals the expected answer (case and spacing ignored). */
export function exactMatch(text: string, expected: JsonValue | undefined): number {
  return typeof expected === 'string' && normalise(text) === normalise(expected) ? 1.0 : 0.0;
}

/** The letter chosen: `Answer: X` if present, else the last standalone capital letter. */
export function chosenOption(text: string): string | undefined {
  const explicit = /answer\s*(?:is)?\s*[:=]?\s*\(?([A-Z])\)?(?![A-Za-z])/i.exec(text);
  if (explicit) return explicit[1]?.toUpperCase();
  const letters = [...text.matchAll(/(?<![A-Za-z])\(?([A-Z])\)?(?![A-Za-z])/g)];
  return letters.at(-1)?.[1];
}

export function multipleChoice(text: string, expected: JsonValue | undefined): number {
  return typeof expected === 'string' && chosenOption(text) === expected.trim().toUpperCase()
    ? 1.0
    : 0.0;
}

/** The last number in the text (commas between digit groups allowed), if any. */
export function lastNumber(text: string): number | undefined {
  const numbers = [...text.matchAll(/-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+/g)];
  const last = numbers.at(-1)?.[0];
  return last === undefined ? undefined : Number(last.replace(/,/g, ''));
}

export const NUMERIC_TOLERANCE = 1e-6;

export function numericMatch(text: string, expected: JsonValue | undefined): number {
  const want = typeof expected === 'string' ? Number(expected) : expected;
  const got = lastNumber(text);
  if (typeof want !== 'number' || !Number.isFinite(want) || got === undefined) return 0.0;
  return Math.abs(got - want) <= NUMERIC_TOLERANCE * Math.max(1, Math.abs(want)) ? 1.0 : 0.0;
}

function verifier(
  app: string,
  score: (text: string, expected: JsonValue | undefined) => number,
): ResourcesServerDefinition {
  return {
    app,
    checkpointMode: 'stateless',
    checkpointVerify: 'replay',
    tools: {},
    verify: (ctx) => ({ reward: score(responseText(ctx.response), expectedAnswer(ctx)) }),
  };
}

export const exactMatchServer = (): ResourcesServerDefinition =>
  verifier('exact_match', exactMatch);
export const multipleChoiceServer = (): ResourcesServerDefinition =>
  verifier('multiple_choice', multipleChoice);
export const numericMatchServer = (): ResourcesServerDefinition =>
  verifier('numeric_match', numericMatch);
