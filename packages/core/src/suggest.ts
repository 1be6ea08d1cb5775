/** "Did you mean …" for a mistyped command, option or stack-file key: the nearest known name, pure. */

/**
 * Edit distance with adjacent swaps (optimal string alignment): the fewest single-character
 * insertions, deletions, substitutions and swaps of two neighbours that turn `a` into `b`. A swap
 * counts once because it is the commonest typo (`stauts`).
 */
export function editDistance(a: string, b: string): number {
  // Row i holds the distances from the first i characters of a to each prefix of b; a swap looks
  // two rows back.
  let twoBack: number[] = [];
  let previous = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const current = [i];
    for (let j = 1; j <= b.length; j++) {
      const substitution = cell(previous, j - 1) + (a[i - 1] === b[j - 1] ? 0 : 1);
      let best = Math.min(cell(previous, j) + 1, cell(current, j - 1) + 1, substitution);
      if (i > 1 && j > 1 && a[i - 1] === b[j - 2] && a[i - 2] === b[j - 1]) {
        best = Math.min(best, cell(twoBack, j - 2) + 1);
      }
      current.push(best);
    }
    twoBack = previous;
    previous = current;
  }
  return cell(previous, b.length);
}

function cell(row: readonly number[], j: number): number {
  return row[j] ?? 0;
}

/**
 * The candidate nearest to `word`, if close enough to be a typo of it: at most one edit per three
 * characters (at least one). Ties go to the earlier candidate.
 */
export function closest(word: string, candidates: Iterable<string>): string | undefined {
  const limit = Math.max(1, Math.floor(word.length / 3));
  let best: { name: string; distance: number } | undefined;
  for (const name of candidates) {
    const distance = editDistance(word, name);
    if (distance <= limit && (best === undefined || distance < best.distance)) {
      best = { name, distance };
    }
  }
  return best?.name;
}

/** ` (did you mean 'x'?)` when there is a suggestion, else nothing. */
export function didYouMean(suggestion: string | undefined): string {
  return suggestion === undefined ? '' : ` (did you mean '${suggestion}'?)`;
}
