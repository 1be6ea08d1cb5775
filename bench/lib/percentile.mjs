// Percentiles as every benchmark reports them: nearest rank over an ascending array.

/** The `p`th percentile of an ascending array (NaN when empty). */
export function percentile(sorted, p) {
  if (sorted.length === 0) return NaN;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

/** p50 / p90 / p99 of `values` (any order). */
export function percentiles(values) {
  const sorted = [...values].sort((a, b) => a - b);
  return { p50: percentile(sorted, 50), p90: percentile(sorted, 90), p99: percentile(sorted, 99) };
}
