/**
 * The summaries the benchmarks print. Several definitions are in use, and a result file's numbers
 * were made with one of them, so each keeps its own name here: swapping `lowerMedian` for
 * `upperMedian` under an unchanged table would move every even-count row.
 * All take the values in any order, leave them as they are, and give NaN for none.
 */

const ascending = (xs: readonly number[]): number[] => [...xs].sort((a, b) => a - b)

/** The arithmetic mean (what sets a rate: the slow tail counts). */
export function mean (xs: readonly number[]): number {
  return xs.length === 0 ? NaN : xs.reduce((a, b) => a + b, 0) / xs.length
}

/** The textbook median: the middle value, or the mean of the two middle ones of an even count. */
export function median (xs: readonly number[]): number {
  const s = ascending(xs)
  if (s.length === 0) return NaN
  return s.length % 2 === 1 ? s[(s.length - 1) / 2]! : (s[s.length / 2 - 1]! + s[s.length / 2]!) / 2
}

/** The lower middle value, s[⌊(n − 1) / 2⌋]: a value that was measured, the smaller one for an even count. */
export function lowerMedian (xs: readonly number[]): number {
  const s = ascending(xs)
  return s.length === 0 ? NaN : s[Math.floor((s.length - 1) / 2)]!
}

/** The upper middle value, s[⌊n / 2⌋]: a value that was measured, the larger one for an even count. */
export function upperMedian (xs: readonly number[]): number {
  const s = ascending(xs)
  return s.length === 0 ? NaN : s[Math.floor(s.length / 2)]!
}

/** The item whose key is the upper middle one (ties keep their order): a whole run, not just its number. */
export function upperMedianBy<T> (items: readonly T[], key: (item: T) => number): T | undefined {
  return [...items].sort((a, b) => key(a) - key(b))[Math.floor(items.length / 2)]
}

/**
 * The nearest-rank percentile, q in (0, 1]: the smallest value with at least a share q of all the
 * values at or below it, s[⌈q·n⌉ − 1] (p99 of 10 values is the largest).
 */
export function nearestRank (xs: readonly number[], q: number): number {
  const s = ascending(xs)
  return s.length === 0 ? NaN : s[Math.min(s.length - 1, Math.max(0, Math.ceil(q * s.length) - 1))]!
}

/**
 * The value at index ⌊q·n⌋, q in [0, 1] (the last one for q·n ≥ n − 1): one rank above
 * `nearestRank` wherever q·n is whole, so `floorRank(xs, 0.5)` is `upperMedian(xs)`.
 */
export function floorRank (xs: readonly number[], q: number): number {
  const s = ascending(xs)
  return s.length === 0 ? NaN : s[Math.min(s.length - 1, Math.floor(q * s.length))]!
}

/**
 * A distribution-free interval for the median, at confidence ≥ 0.95: [s[k − 1], s[n − k]] for the
 * largest k with P(Binomial(n, ½) < k) ≤ 0.025 — the median lies below the kth smallest value
 * only if fewer than k values fall below it. NaNs when n < 6 (no such k).
 */
export function medianInterval (xs: readonly number[]): [number, number] {
  const s = ascending(xs)
  const n = s.length
  let k = 0
  let below = 0 // P(Binomial(n, ½) ≤ k − 1), built up term by term
  let logTerm = -n * Math.LN2 // log P(Binomial(n, ½) = k): in logs, as 0.5 ** n underflows past n ≈ 1,074
  while (k < n && below + Math.exp(logTerm) <= 0.025) {
    below += Math.exp(logTerm)
    logTerm += Math.log((n - k) / (k + 1))
    k++
  }
  return k === 0 ? [NaN, NaN] : [s[k - 1]!, s[n - k]!]
}
