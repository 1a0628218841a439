/**
 * Prompt lookup: drafts without a model by finding the context's last n-gram earlier in the context
 * (prompt and text so far) and proposing what followed it there. It pays on tasks that repeat
 * their input (edits, extraction, code), costs microseconds, and proposes nothing where nothing
 * repeats (then the step is a plain decode).
 */

export interface PromptLookupOptions {
  /** Longest n-gram tried first (default 3). */
  maxNgram?: number
  /** Shortest n-gram accepted (default 1). */
  minNgram?: number
}

/**
 * Up to `k` tokens continuing `context`, copied from after the most recent earlier occurrence of
 * its longest matching suffix n-gram (longer matches are tried first: they predict better).
 */
export function promptLookup (context: readonly number[], k: number, options: PromptLookupOptions = {}): number[] {
  const maxN = Math.max(1, options.maxNgram ?? 3)
  const minN = Math.max(1, Math.min(options.minNgram ?? 1, maxN))
  const len = context.length
  if (k <= 0 || len < 2) return []
  for (let n = Math.min(maxN, len - 1); n >= minN; n--) {
    const tail = len - n
    // Most recent earlier start first; a match must leave at least one token after it.
    for (let start = tail - 1; start >= 0; start--) {
      let same = true
      for (let i = 0; i < n; i++) {
        if (context[start + i] !== context[tail + i]) { same = false; break }
      }
      if (!same) continue
      const from = start + n
      const out: number[] = []
      // The continuation may run into the suffix itself (a repeating pattern): reading the
      // context as it would be extended keeps proposing the cycle.
      for (let i = 0; i < k; i++) {
        const at = from + i
        out.push(at < len ? context[at]! : out[at - len]!)
      }
      return out
    }
  }
  return []
}
